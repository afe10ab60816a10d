"""Start, inspect and stop the local cluster: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, MinIO, CoreDNS, kube-proxy and, per node, containerd and a kubelet, all as plain
processes of this machine (realnodes/ configures the node side).

Every component is started detached (its own session, reparented away from the caller) with a
pid file and a log under the state directory, so a cluster started by `make cluster-up` outlives
that command and can be reused by any later test session. components.py knows each component
(command line, ports, health), proc.py the processes, credentials.py the certificates and
client files; this module sequences them: up, down, status.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable, Sequence

from . import credentials, heartbeat, images, proc
from . import config as C
from . import realnodes as R
from .components import command, components, fingerprint, healthy, refuse_taken_ports, start, wait
from .kube import ApiError, Kube
from .proc import log, sh


BINARIES = ("k8s", "etcd", "helm", "minio", "kwok", "coredns")


def ensure_binaries(components: Sequence[str] = BINARIES) -> None:
    """Build what is missing from the cache (build-binaries.sh knows what a complete cache
    holds, and returns at once when everything is there). Raises when a build fails, so a test
    session that needs the cluster fails instead of skipping."""
    subprocess.run([str(C.HACK / "build-binaries.sh"), *components], check=True)


def prepare(cfg: C.ClusterConfig | None = None, components: Sequence[str] = BINARIES,
            say: Callable[[str], None] | None = None, beat: bool = True,
            images_ready: Callable[[], None] | None = None) -> None:
    """What a first `up` waits for on a new machine, side by side: the nodes' Debian packages
    first (the image builds need buildah), then the Go builds (they keep both cores busy) beside
    the image builds (mostly downloading wheels and writing layers). Seconds when all is there.

    Both builds lock their caches, so a second `prepare` (a test session's `up` while
    `make test` prepares in the background) waits for the first and then finds all built.
    Meanwhile a heartbeat line (heartbeat.py) goes to `say` (default: stderr) every 30 s;
    beat=False for the background prepare, whose output is the log the line points at.
    `images_ready` runs on the images' side as soon as they are built, while the Go builds may
    still run (`up` starts the nodes' containerds and imports the images there)."""
    cfg = cfg or C.load()
    phase = ["installing the nodes' Debian packages (hack/host-packages.sh)"]
    t0 = time.time()

    def text() -> str:
        return heartbeat.line(heartbeat.probe(components, cfg.node_images, t0, phase=phase[0]))

    with heartbeat.beating(text, say) if beat else contextlib.nullcontext():
        host_packages()
        phase[0] = None
        def build_images() -> None:
            images.build(cfg.node_images)
            if images_ready:
                images_ready()

        with ThreadPoolExecutor(1, thread_name_prefix="images") as pool:
            built = pool.submit(build_images)
            ensure_binaries(components)  # a failed Go build raises once the images are done
        built.result()


def host_packages() -> None:
    """The nodes' Debian packages: installed when missing (as root), else named with the
    apt-get line to run."""
    pkgs = subprocess.run([str(C.HACK / "host-packages.sh")], capture_output=True, text=True)
    if pkgs.returncode != 0:
        raise RuntimeError(f"hack/host-packages.sh failed:\n{pkgs.stderr.strip()}")


def prepare_in_background(log_file: Path, components: Sequence[str] = BINARIES) -> int:
    """Start `prepare` detached, its output in log_file, and return its pid at once: `make test`
    and `make demo` build the cluster's binaries and images while they install the Python
    environment; the `up` that needs them waits on the same locks."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as out:
        child = subprocess.Popen([sys.executable, "-m", "hack.localcluster", "prepare", "--no-heartbeat",
                                  *components],
                                 cwd=C.REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    heartbeat.record_background(child.pid, log_file, components)
    return child.pid


def stale_components(cfg: C.ClusterConfig | None = None) -> list[str]:
    """Running components whose configuration or code differs from what `up` would start now.
    They are not restarted automatically (others may be using the cluster): run
    `make cluster-down cluster-up` to apply."""
    cfg = cfg or C.load()
    try:
        sec = json.loads(cfg.secrets_file.read_text())
    except OSError:
        return []
    out = []
    for name in components(cfg):
        rec = cfg.pids / f"{name}.config"
        if proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
            argv, _ = command(cfg, name, sec, write=False)
            if not rec.exists() or rec.read_text() != fingerprint(cfg, name, argv):
                out.append(name)
    return out


def status(cfg: C.ClusterConfig | None = None) -> dict[str, bool]:
    """Health of every component: {"etcd": True, ...}."""
    cfg = cfg or C.load()
    return {name: healthy(cfg, name) for name in components(cfg)}


def is_up(cfg: C.ClusterConfig | None = None) -> bool:
    return all(status(cfg).values())


def up(cfg: C.ClusterConfig | None = None, timeout: float = 180,
       say: Callable[[str], None] | None = None) -> C.ClusterConfig:
    """Build missing binaries, then start whatever is not running. A no-op on a healthy cluster.
    While it waits for the builds and the images' imports, a heartbeat line goes to `say`
    (default: stderr) every 30 s."""
    cfg = cfg or C.load()
    # The nodes' containerds take the images as soon as these are built, beside the Go builds:
    # a cold trainer image's import (3 minutes into both nodes here) leaves the critical path.
    prepare(cfg, say=say, images_ready=lambda: _nodes_early(cfg, timeout, say))
    with proc.locked(cfg):
        return _up(cfg, timeout, say)


def _nodes_early(cfg: C.ClusterConfig, timeout: float, say: Callable[[str], None] | None) -> None:
    """Start the nodes' containerds (Debian's: no Go build needed) and import the images into
    the nodes whose kubelet is not running yet, before the control plane can start. `_up` then
    finds the containerds running and the images present. A cluster already up is left to
    `_up`, which re-imports what changed."""
    with proc.locked(cfg):
        st = status(cfg)
        if all(st.values()):
            return
        sec = _host_state(cfg)
        # A port another process holds is refused before anything starts, as `_up` would refuse
        # it: a refused `up` must not leave the nodes' containerds behind. (After _host_state:
        # some components listen on the bridge's address.)
        for name in components(cfg):
            if not st.get(name) and not proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
                refuse_taken_ports(cfg, name)
        nodes = [R.node_index(n) for n in components(cfg) if n.startswith("kubelet-") and not st.get(n)]
        for i in nodes:
            name = f"containerd-{i}"
            if not st.get(name) and not proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
                argv, e = command(cfg, name, sec)
                start(cfg, name, argv, e)
        for i in nodes:
            wait(cfg, f"containerd-{i}", timeout)
        _load_images(cfg, nodes, clean=True, say=say)


def _host_state(cfg: C.ClusterConfig) -> dict:
    """What every component needs before it starts: a clean slate when nothing of the cluster
    runs (first start, or a machine that lost its processes: no stale pods or half-written
    state are resurrected), the directories, the bridge, certificates and client files.
    Returns the cluster's secrets."""
    if not any(proc.alive(proc.read_pid(cfg, n), proc.marker(cfg, n)) for n in components(cfg)):
        _clean(cfg)
    for sub in ("logs", "pids"):
        (cfg.state_dir / sub).mkdir(parents=True, exist_ok=True)
    R.ensure_bridge(cfg)
    R.ensure_host_network(cfg)
    credentials.ensure_pki(cfg)
    sec = credentials.ensure_secrets(cfg)
    credentials.write_client_files(cfg, sec)
    return sec


def _up(cfg: C.ClusterConfig, timeout: float, say: Callable[[str], None] | None = None) -> C.ClusterConfig:
    t0 = time.time()
    st = status(cfg)
    if all(st.values()):
        log(f"cluster already up ({cfg.state_dir})")
        # the images follow the checkout: rebuilt when their inputs changed, re-imported then
        _load_images(cfg, range(len(cfg.nodes)), say=say)
        stale = stale_components(cfg)
        if stale:
            log(f"WARNING: {', '.join(stale)} run(s) with an older configuration or code than this checkout; "
                "`make cluster-down cluster-up` applies it")
        return cfg
    sec = _host_state(cfg)
    loaded = False
    for name in components(cfg):
        if st.get(name):
            continue
        if name.startswith("kubelet-") and not loaded:
            # every node whose kubelet is about to start (their containerds run by now)
            starting = [R.node_index(n) for n in components(cfg) if n.startswith("kubelet-") and not st.get(n)]
            _load_images(cfg, starting, clean=True, say=say)
            loaded = True
        # A running but (momentarily) unhealthy component is waited for, never restarted: on a
        # loaded machine a slow health check must not take down a cluster that others use.
        if not proc.alive(proc.read_pid(cfg, name), proc.marker(cfg, name)):
            argv, e = command(cfg, name, sec)
            start(cfg, name, argv, e)
        wait(cfg, name, timeout)
        if name == "kube-apiserver":
            _wait_default_ready(cfg)
            _ensure_dns_service(cfg)
    _wait_service_accounts(cfg, timeout)
    log(f"cluster up in {time.time() - t0:.1f}s: source {cfg.env_file}")
    return cfg


def _load_images(cfg: C.ClusterConfig, nodes, clean: bool = False,
                 say: Callable[[str], None] | None = None) -> None:
    """The images the pods run, into each node's containerd (never pulled: no registry), all
    nodes at once: an import is mostly disk writes, and a cold trainer image takes minutes.
    `clean`: first remove the containers a crashed earlier cluster left in a node's
    (persistent) store, before its kubelet starts."""
    def one(i: int) -> None:
        if clean:
            R.stop_pods(cfg, i)
        images.load(R.containerd_address(cfg, i), names=cfg.node_images, prune=True)

    nodes = list(nodes)
    t0 = time.time()
    # a cold trainer image takes minutes to import: never silent meanwhile either
    def text() -> str:
        return (f"starting the cluster: importing the images {', '.join(cfg.node_images)} into "
                f"{', '.join(cfg.nodes[i] for i in nodes)} ({heartbeat.duration(time.time() - t0)} so far)")

    with heartbeat.beating(text, say), ThreadPoolExecutor(max(1, len(nodes)), thread_name_prefix="load") as pool:
        for f in [pool.submit(one, i) for i in nodes]:
            f.result()


def _wait_default_ready(cfg: C.ClusterConfig) -> None:
    kube = Kube.from_state(cfg)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            kube.get("/api/v1/namespaces/default")
            return
        except (ApiError, OSError):
            time.sleep(0.5)
    raise RuntimeError("namespace default never appeared")


def _ensure_dns_service(cfg: C.ClusterConfig) -> None:
    kube = Kube.from_state(cfg)
    for path, obj in R.dns_service_manifests(cfg):
        try:
            kube.create(path, obj)
        except ApiError as e:
            # A Service that exists answers 409, or 422 when its fixed clusterIP is checked
            # first ("provided IP is already allocated", seen with 1.36 on a reused cluster).
            if e.status != 409 and not (e.status == 422 and _exists(kube, f"{path}/{obj['metadata']['name']}")):
                raise


def _exists(kube: Kube, path: str) -> bool:
    try:
        kube.get(path)
        return True
    except ApiError as e:
        if e.status == 404:
            return False
        raise


def _wait_service_accounts(cfg: C.ClusterConfig, timeout: float) -> None:
    """Pods are refused until their namespace has a `default` ServiceAccount (created by the
    controller manager) and projected volumes need kube-root-ca.crt: wait for both."""
    kube = Kube.from_state(cfg)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            kube.get("/api/v1/namespaces/default/serviceaccounts/default")
            kube.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
            return
        except (ApiError, OSError):
            time.sleep(0.5)
    raise RuntimeError("default ServiceAccount/kube-root-ca.crt never appeared: is kube-controller-manager running?")


def _clean(cfg: C.ClusterConfig) -> None:
    for i in range(len(cfg.nodes)):
        R.kill_containers(cfg, i)
    R.remove_network(cfg)
    R.remove_host_state(cfg)
    if cfg.state_dir.exists():
        shutil.rmtree(cfg.state_dir, ignore_errors=True)


def down(cfg: C.ClusterConfig | None = None) -> None:
    """Stop every process of the cluster (pods included) and remove its state and network."""
    cfg = cfg or C.load()
    with proc.locked(cfg):
        _down(cfg)


def _down(cfg: C.ClusterConfig) -> None:
    if cfg.pids.exists():
        for name in ("kueue", "kwok") + tuple(reversed(components(cfg))):  # optional: kueue.py, kwok.py
            if name.startswith("containerd-"):
                R.stop_pods(cfg, R.node_index(name))
            proc.stop(cfg, name)
    _clean(cfg)
    log(f"cluster down ({cfg.state_dir} removed)")


def kubeconfig_path(cfg: C.ClusterConfig | None = None) -> Path:
    return (cfg or C.load()).kubeconfig


def leftover_processes(cfg: C.ClusterConfig | None = None) -> list[str]:
    """Live (non-zombie) processes that belong to this cluster: a command line naming its state
    directory or its socket directory (containerd shims), a root file system under its state
    directory (containers), or living in one of its pod network namespaces."""
    cfg = cfg or C.load()
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and (str(cfg.state_dir) in cmd or str(R.socket_dir(cfg)) in cmd):
            out.append(f"{d.name}: {cmd[:200]}")
            continue
        try:
            if cmd and os.readlink(d / "root").startswith(str(cfg.state_dir)):
                out.append(f"{d.name}: {cmd[:200]} (container)")
        except OSError:
            pass
    for ns in R.pod_netns(cfg):
        out += [f"{p}: in netns {ns}" for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    return out
