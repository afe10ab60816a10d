"""kube-proxy and CoreDNS, one each for the cluster (every node shares the host's network
namespace), and the kube-dns Service whose endpoint is CoreDNS on the host."""
from __future__ import annotations

from .. import config as C
from .layout import CLUSTER_DOMAIN, DNS_SERVICE_IP


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
