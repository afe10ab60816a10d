"""Where the local cluster lives and how it is wired: every knob in one place.

All values can be overridden by environment variables so that a second, independent cluster
(different state directory, ports and subnet) can run next to the first one, which is what the
lifecycle test does.
"""
from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
from pathlib import Path

from .images import NODE_IMAGES, cache_root

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack"


def _versions() -> dict[str, str]:
    out = {}
    for line in (HACK / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


VERSIONS = _versions()

# nodes.node_lost() marks the Node it takes down with this annotation until node_restore().
LOST_ANNOTATION = "localcluster.sftjob.io/lost"


def cache_dir() -> Path:
    return cache_root()


# This repository's own Go tools (hack/tools/<name>): keyed by their sources, not a version.
OWN_TOOLS = ("health", "netpol")


def own_tool_key(name: str) -> str:
    """What build-binaries.sh names the cache of hack/tools/<name> by: the first 12 hex digits
    of the sha256 of go.mod, go.sum and the .go files, in that order (`cat ... | sha256sum`)."""
    src = HACK / "tools" / name
    data = b"".join(f.read_bytes() for f in (src / "go.mod", src / "go.sum", *sorted(src.glob("*.go"))))
    return hashlib.sha256(data).hexdigest()[:12]


def bin_dir(component: str) -> Path:
    """The cached bin/ directory of one component (k8s, etcd, helm, minio, kwok, coredns, kueue,
    and the own tools health and netpol)."""
    if component in OWN_TOOLS:
        return cache_dir() / f"{component}-{own_tool_key(component)}" / "bin"
    key = {"k8s": "K8S_VERSION", "etcd": "ETCD_VERSION", "helm": "HELM_VERSION",
           "minio": "MINIO_VERSION", "kwok": "KWOK_VERSION", "kueue": "KUEUE_VERSION",
           "coredns": "COREDNS_VERSION"}[component]
    return cache_dir() / f"{component}-{VERSIONS[key]}" / "bin"


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    state_dir: Path
    # The bridge that pod network namespaces hang off. Its address is also where the API server
    # and MinIO listen, so that the host and the pods reach them at the same URL.
    bridge: str
    subnet: ipaddress.IPv4Network
    apiserver_port: int
    etcd_port: int
    etcd_peer_port: int
    minio_port: int
    kcm_port: int
    scheduler_port: int
    kubelet_port: int
    kube_proxy_port: int          # healthz
    kube_proxy_metrics_port: int
    dns_health_port: int
    nodes: tuple[str, ...]
    node_pods: str
    # kube-proxy's iptables chains have fixed names in the host's network namespace: only one
    # cluster per machine can route Services. A second cluster (the lifecycle test) runs without.
    service_proxy: bool
    # what `up` imports into each node's containerd (hack/localcluster/images/spec.py names)
    node_images: tuple[str, ...]

    @property
    def host_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def node_subnet(self, index: int) -> ipaddress.IPv4Network:
        """Node i hands out pod IPs from the i+1-th /24 of the cluster subnet."""
        return list(self.subnet.subnets(new_prefix=24))[index + 1]

    @property
    def apiserver_url(self) -> str:
        return f"https://{self.host_ip}:{self.apiserver_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.host_ip}:{self.minio_port}"

    # Files under the state directory.
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pids(self) -> Path:
        return self.state_dir / "pids"

    @property
    def secrets_file(self) -> Path:
        return self.state_dir / "secrets.json"


def load(environ: dict[str, str] | None = None) -> ClusterConfig:
    e = os.environ if environ is None else environ
    n_nodes = int(e.get("SFTJOB_NODES", "2"))
    prefix = e.get("SFTJOB_NODE_PREFIX", "sftjob-node-")
    return ClusterConfig(
        state_dir=Path(e.get("SFTJOB_CLUSTER_DIR") or REPO / ".cluster").resolve(),
        bridge=e.get("SFTJOB_CLUSTER_BRIDGE", "sftjob0"),
        subnet=ipaddress.ip_network(e.get("SFTJOB_CLUSTER_SUBNET", "10.244.0.0/16")),
        apiserver_port=int(e.get("SFTJOB_APISERVER_PORT", "6443")),
        etcd_port=int(e.get("SFTJOB_ETCD_PORT", "2379")),
        etcd_peer_port=int(e.get("SFTJOB_ETCD_PEER_PORT", "2380")),
        minio_port=int(e.get("SFTJOB_MINIO_PORT", "9000")),
        kcm_port=int(e.get("SFTJOB_KCM_PORT", "10257")),
        scheduler_port=int(e.get("SFTJOB_SCHEDULER_PORT", "10259")),
        kubelet_port=int(e.get("SFTJOB_KUBELET_PORT", "10250")),
        kube_proxy_port=int(e.get("SFTJOB_KUBE_PROXY_PORT", "10256")),
        kube_proxy_metrics_port=int(e.get("SFTJOB_KUBE_PROXY_METRICS_PORT", "10249")),
        dns_health_port=int(e.get("SFTJOB_DNS_HEALTH_PORT", "10280")),
        nodes=tuple(f"{prefix}{i}" for i in range(n_nodes)),
        node_pods=e.get("SFTJOB_NODE_PODS", "20"),
        service_proxy=e.get("SFTJOB_SERVICE_PROXY", "1") not in ("0", "false", "no"),
        node_images=tuple(e.get("SFTJOB_NODE_IMAGES", ",".join(NODE_IMAGES)).split(",")),
    )
