"""Real nodes for the local cluster: per node a containerd (runc, CNI bridge) and an upstream
kubelet; for the cluster kube-proxy (iptables) and CoreDNS. All run as host processes next to
the control plane, started and supervised by cluster.py like every other component.

Modules: layout (directories, sockets, addresses), containerd, kubelet, services (kube-proxy,
CoreDNS, the kube-dns Service), network (the bridge, CNI, what pods leave on the host), files
(the configuration files written for each component).

Layout of one node (i = 0, 1, ...), under the state directory:

    nodes/<node>/containerd/state         containerd's runtime state
    nodes/<node>/cni/                     its CNI config and host-local IPAM data
    nodes/<node>/pod-logs/                kubelet podLogsDir (what `kubectl logs` reads)

containerd's root (its image store, several GB once the trainer image is imported) lives in the
binary cache, ${SFTJOB_CACHE}/node-store/<bridge>-<i>, and outlives `cluster-down`: importing
the images is the slowest part of a cold start (and several GB per node), so it happens once
per machine and image version, whichever checkout starts the cluster (two clusters with the
same bridge cannot run at once: their ports collide, and `up` refuses). Containers and
sandboxes are removed from it on `down` and before a kubelet starts. Sockets live in a short
directory under /run (unix socket paths are limited to 107 bytes and a checkout may sit deep in
the file system).

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
from .containerd import (containerd_argv, ctr_argv, kill_containers, signal_container, stop_pods, tag_image,
                         task_pid)
from .files import config_text, write_cluster_files, write_node_files
from .kubelet import kubelet_argv
from .layout import (CLUSTER_DOMAIN, DNS_SERVICE_IP, SERVICE_CIDR, containerd_address, node_dir, node_index, node_ip,
                     socket_dir, store_dir)
from .network import ensure_bridge, ensure_host_network, pod_netns, remove_host_state, remove_network
from .services import coredns_argv, dns_service_manifests, kube_proxy_argv

__all__ = ["CLUSTER_DOMAIN", "DNS_SERVICE_IP", "SERVICE_CIDR", "config_text", "containerd_address", "containerd_argv",
           "coredns_argv", "ctr_argv", "dns_service_manifests", "ensure_bridge", "ensure_host_network",
           "kill_containers", "kube_proxy_argv", "kubelet_argv", "node_dir", "node_index", "node_ip", "pod_netns",
           "remove_host_state", "remove_network", "signal_container", "socket_dir", "stop_pods", "store_dir",
           "tag_image", "task_pid", "write_cluster_files", "write_node_files"]
