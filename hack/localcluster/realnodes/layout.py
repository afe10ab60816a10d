"""Where each node's pieces live and how it is addressed: directories, sockets, the node's
own address on the bridge, and the cluster-wide names and addresses every node shares."""
from __future__ import annotations

import hashlib
from pathlib import Path

from .. import config as C

CLUSTER_DOMAIN = "cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
DNS_SERVICE_IP = "10.96.0.10"
CNI_BIN = "/usr/lib/cni"   # Debian's containernetworking-plugins (hack/host-packages.sh installs it)


def _digest(cfg: C.ClusterConfig) -> str:
    return hashlib.sha1(str(cfg.state_dir).encode()).hexdigest()[:10]


def socket_dir(cfg: C.ClusterConfig) -> Path:
    return Path("/run") / f"sftjob-{_digest(cfg)}"


def kubelet_root(cfg: C.ClusterConfig, i: int) -> Path:
    """kubelet --root-dir (pod volumes, plugin and pod-resources sockets): short, for the sockets."""
    return Path("/var/lib/sftjob") / f"{_digest(cfg)}-{i}"


def store_dir(cfg: C.ClusterConfig, i: int) -> Path:
    """containerd's root for node i: its images survive `cluster-down` (see the package doc)."""
    return C.cache_dir() / "node-store" / f"{cfg.bridge}-{i}"


def containerd_address(cfg: C.ClusterConfig, i: int) -> str:
    return str(socket_dir(cfg) / f"containerd-{i}.sock")


def node_dir(cfg: C.ClusterConfig, i: int) -> Path:
    return cfg.state_dir / "nodes" / cfg.nodes[i]


def node_index(name: str) -> int:
    """i of a per-node component's name (containerd-i, kubelet-i)."""
    return int(name.rsplit("-", 1)[1])


def node_ip(cfg: C.ClusterConfig, i: int) -> str:
    """The node's own address on the bridge (its kubelet's InternalIP): .11, .12, ..."""
    return str(cfg.subnet.network_address + 11 + i)
