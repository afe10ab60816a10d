"""The pod network on the host: the cluster bridge with the host's and the nodes' addresses,
each node's CNI configuration (bridge + host-local), and the removal of what pods and
kube-proxy leave on the host."""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
from pathlib import Path

from .. import config as C
from ..proc import sh
from .layout import node_dir, node_ip, socket_dir


def cni_config(cfg: C.ClusterConfig, i: int) -> dict:
    sub = cfg.node_subnet(i)
    return {
        "cniVersion": "0.4.0",
        "name": "sftjob",
        "plugins": [
            {
                "type": "bridge", "bridge": cfg.bridge, "isDefaultGateway": True,
                "ipMasq": False, "hairpinMode": True,
                "ipam": {
                    "type": "host-local", "dataDir": str(node_dir(cfg, i) / "cni" / "ipam"),
                    "ranges": [[{"subnet": str(cfg.subnet), "rangeStart": str(sub.network_address + 2),
                                 "rangeEnd": str(sub.broadcast_address - 1), "gateway": cfg.host_ip}]],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def ensure_bridge(cfg: C.ClusterConfig) -> None:
    """The bridge carries the host's address in the cluster subnet; pods hang off it."""
    if sh("ip", "link", "show", cfg.bridge, check=False).returncode != 0:
        sh("ip", "link", "add", cfg.bridge, "type", "bridge")
    addr = f"{cfg.host_ip}/{cfg.subnet.prefixlen}"
    if addr not in sh("ip", "-o", "addr", "show", "dev", cfg.bridge).stdout:
        sh("ip", "addr", "add", addr, "dev", cfg.bridge)
    sh("ip", "link", "set", cfg.bridge, "up")


def remove_network(cfg: C.ClusterConfig) -> None:
    """Delete the pod network namespaces left with an address of this cluster's subnet (a node
    stopped without tearing its pods down; killing anything left in them) and the bridge."""
    for ns in pod_netns(cfg):
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", cfg.bridge, check=False)


def ensure_host_network(cfg: C.ClusterConfig) -> None:
    """Node addresses on the bridge, and forwarding on (pods reach Services through the host)."""
    have = sh("ip", "-o", "addr", "show", "dev", cfg.bridge).stdout
    for i in range(len(cfg.nodes)):
        addr = f"{node_ip(cfg, i)}/32"
        if f" {addr} " not in have:
            sh("ip", "addr", "add", addr, "dev", cfg.bridge)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    # Pods talking to a Service on the same bridge come back through it (hairpin): the bridge
    # must let the host see that traffic for kube-proxy's rules.
    try:
        Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1\n")
    except OSError:
        pass


def remove_host_state(cfg: C.ClusterConfig) -> None:
    """kube-proxy's iptables chains (they would redirect a next cluster's Services) and the
    socket directory. Pods' network namespaces are removed by CNI when containerd tears down
    sandboxes; those a crashed node left are found by pod_netns() and removed by
    remove_network()."""
    kp = C.bin_dir("k8s") / "kube-proxy"
    if kp.exists() and cfg.service_proxy:
        sh(str(kp), "--cleanup", "--proxy-mode=iptables", check=False)
    shutil.rmtree(socket_dir(cfg), ignore_errors=True)


def pod_netns(cfg: C.ClusterConfig) -> list[str]:
    """Named network namespaces (containerd's cni-*) holding an address of the cluster subnet."""
    out = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith("cni-"):
            continue
        addrs = sh("ip", "-n", ns, "-4", "-o", "addr", "show", check=False).stdout
        for word in addrs.split():
            if "/" in word:
                try:
                    if ipaddress.ip_interface(word).ip in cfg.subnet:
                        out.append(ns)
                        break
                except ValueError:
                    pass
    return out
