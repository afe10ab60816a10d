"""containerd per node: its configuration (runc, overlayfs, the CNI bridge, the pause image
as the sandbox), its command line, and what `ctr` does against it: stop and remove the pods'
containers, kill what a crashed node left, find, signal and tag images of one container."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import config as C
from ..images import PAUSE_REF
from ..proc import sh
from .layout import CNI_BIN, containerd_address, kubelet_root, node_dir, store_dir


def containerd_config(cfg: C.ClusterConfig, i: int) -> str:
    d, sock = node_dir(cfg, i), containerd_address(cfg, i)
    return f"""version = 2
root = "{store_dir(cfg, i)}"
state = "{d}/containerd/state"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{sock}"

[ttrpc]
  address = "{sock}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_REF}"
  # no CAP_SYS_RESOURCE here: runc must not be asked for a negative oom_score_adj
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d}/cni/net.d"
"""


def containerd_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    return ["containerd", "--config", str(node_dir(cfg, i) / "containerd.toml")]


def ctr_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    """`ctr` against node i's containerd, in the CRI's namespace."""
    return ["ctr", "--address", containerd_address(cfg, i), "-n", "k8s.io"]


def stop_pods(cfg: C.ClusterConfig, i: int) -> None:
    """Before node i's containerd stops: kill and delete every container task it runs, so its
    shims exit and nothing of the pods outlives the cluster."""
    if not Path(containerd_address(cfg, i)).exists():
        return
    ctr = ctr_argv(cfg, i)
    tasks = [line.split()[0] for line in sh(*ctr, "tasks", "ls", check=False).stdout.splitlines()[1:] if line.split()]
    for t in tasks:
        sh(*ctr, "tasks", "kill", "--all", "--signal", "SIGKILL", t, check=False)
    for t in tasks:
        sh(*ctr, "tasks", "delete", "--force", t, check=False)
    # containers and pod sandboxes go too (the image store outlives the cluster): a kubelet
    # of the next cluster must not find the pods of this one
    containers = sh(*ctr, "containers", "ls", "-q", check=False).stdout.split()
    if containers:
        sh(*ctr, "containers", "rm", *containers, check=False)


def kill_containers(cfg: C.ClusterConfig, i: int) -> None:
    """Stop whatever containerd-shim and container processes node i left (after its containerd
    and kubelet are stopped): the shims outlive containerd by design."""
    root = str(store_dir(cfg, i))
    sock = containerd_address(cfg, i)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "containerd-shim" in cmd and sock in cmd:
            # killing the shim's process group takes the containers with it
            try:
                os.killpg(int(d.name), 9)
            except OSError:
                try:
                    os.kill(int(d.name), 9)
                except OSError:
                    pass
    # overlay mounts of the snapshots and the pods' volume mounts under kubelet's root
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    prefixes = (str(node_dir(cfg, i)), root, str(kubelet_root(cfg, i)))
    for m in sorted(mounts, key=len, reverse=True):
        if m.startswith(prefixes):
            sh("umount", "-l", m, check=False)
    shutil.rmtree(kubelet_root(cfg, i), ignore_errors=True)


def _ctr_for(cfg: C.ClusterConfig, node: str) -> list[str]:
    return ctr_argv(cfg, cfg.nodes.index(node))


def task_pid(cfg: C.ClusterConfig, node: str, container_id: str) -> int | None:
    """The host pid of a container's main process (containerID `containerd://<id>` of a pod on
    NODE), or None when it does not run."""
    cid = container_id.split("://", 1)[-1]
    for line in sh(*_ctr_for(cfg, node), "tasks", "ls", check=False).stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[0] == cid and parts[2] == "RUNNING":
            return int(parts[1])
    return None


def signal_container(cfg: C.ClusterConfig, node: str, container_id: str, sig: str = "SIGKILL") -> None:
    """Send SIG to every process of one container, through its node's containerd (what a
    crash, the OOM killer or `kill -9` inside the container would do; the pod is untouched)."""
    cid = container_id.split("://", 1)[-1]
    sh(*_ctr_for(cfg, node), "tasks", "kill", "--all", "--signal", sig, cid)


def tag_image(cfg: C.ClusterConfig, source: str, target: str) -> None:
    """Give an image every node holds a second name on every node (as a registry would serve
    one image under two tags)."""
    for node in cfg.nodes:
        sh(*_ctr_for(cfg, node), "images", "tag", "--force", source, target)
