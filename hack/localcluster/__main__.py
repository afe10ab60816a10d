"""python -m hack.localcluster COMMAND: up [--kueue]; beat --what TEXT [--venv DIR] -- COMMAND...;
prepare [--background LOG] [--no-heartbeat] [COMPONENT ...]; down; status; env;
node-lost NODE [--delete-pods]; node-restore NODE; logs NS POD [CONTAINER]; kwok-up; kwok-down;
kueue-up; kueue-down."""
import argparse
import sys
from pathlib import Path

from . import cluster, heartbeat, kueue, kwok, nodes


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.localcluster")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="build missing binaries and start the cluster (no-op when up)")
    p.add_argument("--kueue", action="store_true", help="also start Kueue (see hack/localcluster/kueue.py)")
    p = sub.add_parser("prepare", help="install the nodes' Debian packages, then build the binaries and the images "
                                         "side by side (what a first `up` waits for)")
    p.add_argument("components", nargs="*", default=list(cluster.BINARIES),
                   help=f"binaries to build (default: {' '.join(cluster.BINARIES)}; kueue is optional)")
    p.add_argument("--background", metavar="LOG", help="return at once; the output goes to LOG")
    p.add_argument("--no-heartbeat", action="store_true",
                   help="no progress line every 30 s (the background prepare: its output is the log)")
    p = sub.add_parser("beat", help="run a command, saying every 30 s what it is and how long it has run "
                                    "(make install's pip)")
    p.add_argument("--what", required=True, help="what the command does, as the line names it")
    p.add_argument("--venv", type=Path, help="count the packages this virtual environment holds")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command")
    sub.add_parser("down", help="stop every process of the cluster and remove its state")
    sub.add_parser("status", help="health of each component; exit 1 unless all are healthy")
    sub.add_parser("env", help="print the shell exports of .cluster/env")
    p = sub.add_parser("node-lost", help="simulate the loss of a node")
    p.add_argument("node")
    p.add_argument("--delete-pods", action="store_true", help="also force-delete its pods")
    p = sub.add_parser("node-restore", help="bring a lost node back")
    p.add_argument("node")
    p = sub.add_parser("logs", help="print a pod's container log (as `kubectl logs`)")
    p.add_argument("namespace")
    p.add_argument("pod")
    p.add_argument("container", nargs="?", help="default: the pod's only container")
    p = sub.add_parser("kwok-up", help="start kwok with N fake nodes (scale tests)")
    p.add_argument("--nodes", type=int, default=10)
    sub.add_parser("kwok-down", help="stop kwok and delete the fake nodes")
    sub.add_parser("kueue-up", help="start Kueue (pod integration) on the running cluster")
    sub.add_parser("kueue-down", help="stop Kueue and unregister its webhooks")
    a = ap.parse_args()
    if a.cmd == "up":
        cfg = cluster.up()
        if a.kueue:
            kueue.kueue_up(cfg)
        print(f"cluster up: source {cfg.env_file}")
    elif a.cmd == "prepare":
        if a.background:
            pid = cluster.prepare_in_background(Path(a.background).resolve(), a.components)
            print(f"building the cluster's binaries and images in the background (pid {pid}, log {a.background})")
        else:
            cluster.prepare(components=a.components, beat=not a.no_heartbeat)
    elif a.cmd == "beat":
        argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
        return heartbeat.run_beating(argv, a.what, a.venv)
    elif a.cmd == "down":
        cluster.down()
    elif a.cmd == "status":
        st = cluster.status()
        for name, ok in st.items():
            print(f"{name:26s} {'ok' if ok else 'DOWN'}")
        cfg = cluster.C.load()
        if all(st.values()):
            print(f"kubeconfig: {cfg.kubeconfig}\nenv:        {cfg.env_file}\n"
                  f"logs:       {cfg.logs}/<component>.log; pods: kubectl logs")
        return 0 if all(st.values()) else 1
    elif a.cmd == "env":
        print(cluster.C.load().env_file.read_text(), end="")
    elif a.cmd == "node-lost":
        nodes.node_lost(a.node, delete_pods=a.delete_pods)
    elif a.cmd == "node-restore":
        nodes.node_restore(a.node)
    elif a.cmd == "logs":
        text = nodes.pod_log(a.namespace, a.pod, a.container)
        if not text:
            print(f"no logs for {a.namespace}/{a.pod} (gone, or not started)", file=sys.stderr)
            return 1
        sys.stdout.write(text)
    elif a.cmd == "kwok-up":
        print("\n".join(kwok.kwok_up(a.nodes)))
    elif a.cmd == "kwok-down":
        kwok.kwok_down()
    elif a.cmd == "kueue-up":
        kueue.kueue_up()
    elif a.cmd == "kueue-down":
        kueue.kueue_down()
    return 0


sys.exit(main())
