"""The configuration files this package writes for each component, and their text (what a
running component's fingerprint covers, so that a changed configuration is noticed)."""
from __future__ import annotations

import json

from .. import config as C
from .containerd import containerd_config
from .kubelet import kubelet_config
from .layout import kubelet_root, node_dir, node_index, socket_dir
from .network import cni_config
from .services import corefile, kube_proxy_config


def write_node_files(cfg: C.ClusterConfig, i: int) -> None:
    d = node_dir(cfg, i)
    for sub in ("containerd", "cni/net.d", "cni/ipam", "pod-logs"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    kubelet_root(cfg, i).mkdir(parents=True, exist_ok=True)
    socket_dir(cfg).mkdir(parents=True, exist_ok=True)
    (d / "containerd.toml").write_text(containerd_config(cfg, i))
    (d / "cni" / "net.d" / "10-sftjob.conflist").write_text(json.dumps(cni_config(cfg, i), indent=2))
    (d / "kubelet.yaml").write_text(json.dumps(kubelet_config(cfg, i), indent=2))


def write_cluster_files(cfg: C.ClusterConfig) -> None:
    (cfg.state_dir / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(cfg), indent=2))
    (cfg.state_dir / "Corefile").write_text(corefile(cfg))


def config_text(cfg: C.ClusterConfig, name: str) -> str:
    """Every configuration this package writes for component NAME ("" for the control plane)."""
    if name in ("coredns", "kube-proxy"):
        return corefile(cfg) + json.dumps(kube_proxy_config(cfg))
    if name.startswith(("containerd-", "kubelet-")):
        i = node_index(name)
        return containerd_config(cfg, i) + json.dumps(cni_config(cfg, i)) + json.dumps(kubelet_config(cfg, i))
    return ""
