"""Real nodes for the local cluster: per node a containerd (runc, CNI bridge) and an upstream
kubelet; for the cluster kube-proxy (iptables) and CoreDNS. All run as host processes next to
the control plane, started and supervised by cluster.py like every other component.

Layout of one node (i = 0, 1, ...), under the state directory:

    nodes/<node>/containerd/state         containerd's runtime state
    nodes/<node>/cni/                     its CNI config and host-local IPAM data
    nodes/<node>/pod-logs/                kubelet podLogsDir (what `kubectl logs` reads)

containerd's root (its image store, several GB once the trainer image is imported) lives in the
binary cache, ${SFTJOB_CACHE}/node-store/<bridge>-<i>, and outlives `cluster-down`: importing
the images is the slowest part of a cold start (and several GB per node), so it happens once
per machine and image version, whichever checkout starts the cluster (two clusters with the
same bridge cannot run at once: their ports collide, and `up` refuses). Containers and
sandboxes are removed from it on `down` and before a kubelet starts. Sockets live in a short directory under /run (unix socket paths are limited to 107
bytes and a checkout may sit deep in the file system).

Every node's pods hang off the one cluster bridge, so the pod network is flat: node i hands
out addresses from the i+1-th /24 of the cluster subnet and the host (control plane, MinIO,
CoreDNS) is the bridge's address. Each node also has an address of its own on the bridge, on
which its kubelet serves (logs, exec, port-forward).

What this machine lacks and how the configuration answers it (checked on Debian bookworm in a
container sandbox): cgroups are v1 in hybrid mode (kubelet failCgroupV1: false, cgroupfs
driver, runc: crun refuses the layout); CAP_SYS_RESOURCE is missing (containerd's
restrict_oom_score_adj, so runc never writes a negative oom_score_adj); QoS cgroups and node
allocatable enforcement are off (the hierarchy is not ours to reorganise).
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

from . import config as C
from .images import PAUSE_REF

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
    """containerd's root for node i: its images survive `cluster-down` (see the module doc)."""
    return C.cache_dir() / "node-store" / f"{cfg.bridge}-{i}"


def containerd_address(cfg: C.ClusterConfig, i: int) -> str:
    return str(socket_dir(cfg) / f"containerd-{i}.sock")


def node_dir(cfg: C.ClusterConfig, i: int) -> Path:
    return cfg.state_dir / "nodes" / cfg.nodes[i]


def node_ip(cfg: C.ClusterConfig, i: int) -> str:
    """The node's own address on the bridge (its kubelet's InternalIP): .11, .12, ..."""
    return str(cfg.subnet.network_address + 11 + i)


# --------------------------------------------------------------------------------------------
# containerd


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


# --------------------------------------------------------------------------------------------
# kubelet


def kubelet_config(cfg: C.ClusterConfig, i: int) -> dict:
    d = node_dir(cfg, i)
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip(cfg, i),
        "port": cfg.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": node_ip(cfg, i),
        "healthzPort": 10248,
        "containerRuntimeEndpoint": f"unix://{containerd_address(cfg, i)}",
        "podLogsDir": str(d / "pod-logs"),
        # the API server authenticates with a client certificate of the cluster CA and is
        # authorised like any other client (SubjectAccessReview)
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(cfg.pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(cfg.pki / f"kubelet-{i}.crt"),
        "tlsPrivateKeyFile": str(cfg.pki / f"kubelet-{i}.key"),
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [DNS_SERVICE_IP],
        "maxPods": int(cfg.node_pods),
        # this machine: cgroup v1 (hybrid), no swap accounting, the hierarchy is not ours
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "localStorageCapacityIsolation": False,
        # images are imported, never pulled: never garbage-collect them
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # node pressure on a shared test machine should not evict training pods
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        # a stopped kubelet is noticed within the controller manager's grace period
        "nodeStatusUpdateFrequency": "4s",
        "nodeLeaseDurationSeconds": 12,
        "serializeImagePulls": False,
        "registerNode": True,
        "shutdownGracePeriod": "0s",
    }


def write_node_files(cfg: C.ClusterConfig, i: int) -> None:
    d = node_dir(cfg, i)
    for sub in ("containerd", "cni/net.d", "cni/ipam", "pod-logs"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    kubelet_root(cfg, i).mkdir(parents=True, exist_ok=True)
    socket_dir(cfg).mkdir(parents=True, exist_ok=True)
    (d / "containerd.toml").write_text(containerd_config(cfg, i))
    (d / "cni" / "net.d" / "10-sftjob.conflist").write_text(json.dumps(cni_config(cfg, i), indent=2))
    (d / "kubelet.yaml").write_text(json.dumps(kubelet_config(cfg, i), indent=2))


def containerd_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    return ["containerd", "--config", str(node_dir(cfg, i) / "containerd.toml")]


def kubelet_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    d = node_dir(cfg, i)
    return [str(C.bin_dir("k8s") / "kubelet"), f"--config={d}/kubelet.yaml",
            f"--kubeconfig={cfg.state_dir}/node-kubeconfig", f"--root-dir={kubelet_root(cfg, i)}",
            f"--hostname-override={cfg.nodes[i]}", f"--node-ip={node_ip(cfg, i)}",
            f"--node-labels=sftjob.io/local-node={i}", "--v=1"]


# --------------------------------------------------------------------------------------------
# kube-proxy and CoreDNS (one each: every node shares the host's network namespace)


def kube_proxy_config(cfg: C.ClusterConfig) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(cfg.state_dir / "node-kubeconfig")},
        "mode": "iptables",
        "clusterCIDR": str(cfg.subnet),
        "hostnameOverride": cfg.nodes[0],
        "bindAddress": cfg.host_ip,
        "nodePortAddresses": [f"{cfg.host_ip}/32"],
        "healthzBindAddress": f"127.0.0.1:{cfg.kube_proxy_port}",
        "metricsBindAddress": f"127.0.0.1:{cfg.kube_proxy_metrics_port}",
        # Pods on the one bridge reach Services through the host: masquerade every Service
        # connection so replies return the same way, whatever br_netfilter does.
        "iptables": {"masqueradeAll": True, "syncPeriod": "30s", "minSyncPeriod": "0s"},
        # conntrack sysctls are the host's: leave them alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def kube_proxy_argv(cfg: C.ClusterConfig) -> list[str]:
    return [str(C.bin_dir("k8s") / "kube-proxy"), f"--config={cfg.state_dir}/kube-proxy.yaml", "--v=1"]


def corefile(cfg: C.ClusterConfig) -> str:
    return f""".:53 {{
    bind {cfg.host_ip}
    errors
    health 127.0.0.1:{cfg.dns_health_port}
    ready 127.0.0.1:{cfg.dns_health_port + 1}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {cfg.state_dir}/node-kubeconfig sftjob-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
    loadbalance
    forward . /etc/resolv.conf
}}
"""


def coredns_argv(cfg: C.ClusterConfig) -> list[str]:
    return [str(C.bin_dir("coredns") / "coredns"), "-conf", str(cfg.state_dir / "Corefile")]


def write_cluster_files(cfg: C.ClusterConfig) -> None:
    (cfg.state_dir / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(cfg), indent=2))
    (cfg.state_dir / "Corefile").write_text(corefile(cfg))


def dns_service_manifests(cfg: C.ClusterConfig) -> list[tuple[str, dict]]:
    """(collection path, object): the kube-dns Service, selector-less, whose endpoint is CoreDNS
    on the host. Pods' resolv.conf names its ClusterIP (kubelet clusterDNS)."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
           "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [{**p, "targetPort": 53} for p in ports]}}
    eps = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": "kube-dns-host", "namespace": "kube-system",
                        "labels": {"kubernetes.io/service-name": "kube-dns",
                                   "endpointslice.kubernetes.io/managed-by": "localcluster.sftjob.io"}},
           "addressType": "IPv4",
           "endpoints": [{"addresses": [cfg.host_ip], "conditions": {"ready": True}}],
           "ports": ports}
    return [("/api/v1/namespaces/kube-system/services", svc),
            ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices", eps)]


# --------------------------------------------------------------------------------------------
# host network


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def ensure_host_network(cfg: C.ClusterConfig) -> None:
    """Node addresses on the bridge, and forwarding on (pods reach Services through the host)."""
    have = _sh("ip", "-o", "addr", "show", "dev", cfg.bridge).stdout
    for i in range(len(cfg.nodes)):
        addr = f"{node_ip(cfg, i)}/32"
        if f" {addr} " not in have:
            _sh("ip", "addr", "add", addr, "dev", cfg.bridge)
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
    cluster.remove_network()."""
    kp = C.bin_dir("k8s") / "kube-proxy"
    if kp.exists() and cfg.service_proxy:
        _sh(str(kp), "--cleanup", "--proxy-mode=iptables", check=False)
    shutil.rmtree(socket_dir(cfg), ignore_errors=True)


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
            _sh("umount", "-l", m, check=False)
    shutil.rmtree(kubelet_root(cfg, i), ignore_errors=True)


def pod_netns(cfg: C.ClusterConfig) -> list[str]:
    """Named network namespaces (containerd's cni-*) holding an address of the cluster subnet."""
    out = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith("cni-"):
            continue
        addrs = _sh("ip", "-n", ns, "-4", "-o", "addr", "show", check=False).stdout
        for word in addrs.split():
            if "/" in word:
                try:
                    if ipaddress.ip_interface(word).ip in cfg.subnet:
                        out.append(ns)
                        break
                except ValueError:
                    pass
    return out


def stop_pods(cfg: C.ClusterConfig, i: int) -> None:
    """Before node i's containerd stops: kill and delete every container task it runs, so its
    shims exit and nothing of the pods outlives the cluster."""
    if not Path(containerd_address(cfg, i)).exists():
        return
    ctr = ctr_argv(cfg, i)
    tasks = [line.split()[0] for line in _sh(*ctr, "tasks", "ls", check=False).stdout.splitlines()[1:] if line.split()]
    for t in tasks:
        _sh(*ctr, "tasks", "kill", "--all", "--signal", "SIGKILL", t, check=False)
    for t in tasks:
        _sh(*ctr, "tasks", "delete", "--force", t, check=False)
    # containers and pod sandboxes go too (the image store outlives the cluster): a kubelet
    # of the next cluster must not find the pods of this one
    containers = _sh(*ctr, "containers", "ls", "-q", check=False).stdout.split()
    if containers:
        _sh(*ctr, "containers", "rm", *containers, check=False)


def config_text(cfg: C.ClusterConfig, name: str) -> str:
    """Every configuration this module writes for component NAME ("" for the control plane)."""
    if name in ("coredns", "kube-proxy"):
        return corefile(cfg) + json.dumps(kube_proxy_config(cfg))
    if name.startswith(("containerd-", "kubelet-")):
        i = int(name.rsplit("-", 1)[1])
        return containerd_config(cfg, i) + json.dumps(cni_config(cfg, i)) + json.dumps(kubelet_config(cfg, i))
    return ""


def ctr_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    """`ctr` against node i's containerd, in the CRI's namespace."""
    return ["ctr", "--address", containerd_address(cfg, i), "-n", "k8s.io"]


def _ctr_for(cfg: C.ClusterConfig, node: str) -> list[str]:
    return ctr_argv(cfg, cfg.nodes.index(node))


def task_pid(cfg: C.ClusterConfig, node: str, container_id: str) -> int | None:
    """The host pid of a container's main process (containerID `containerd://<id>` of a pod on
    NODE), or None when it does not run."""
    cid = container_id.split("://", 1)[-1]
    for line in _sh(*_ctr_for(cfg, node), "tasks", "ls", check=False).stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[0] == cid and parts[2] == "RUNNING":
            return int(parts[1])
    return None


def signal_container(cfg: C.ClusterConfig, node: str, container_id: str, sig: str = "SIGKILL") -> None:
    """Send SIG to every process of one container, through its node's containerd (what a
    crash, the OOM killer or `kill -9` inside the container would do; the pod is untouched)."""
    cid = container_id.split("://", 1)[-1]
    _sh(*_ctr_for(cfg, node), "tasks", "kill", "--all", "--signal", sig, cid)


def tag_image(cfg: C.ClusterConfig, source: str, target: str) -> None:
    """Give an image every node holds a second name on every node (as a registry would serve
    one image under two tags)."""
    for node in cfg.nodes:
        _sh(*_ctr_for(cfg, node), "images", "tag", "--force", source, target)
