"""The kubelet per node: its configuration for this machine (cgroup v1, no QoS hierarchy,
fast node status, never garbage-collected images) and its command line."""
from __future__ import annotations

from .. import config as C
from .layout import CLUSTER_DOMAIN, DNS_SERVICE_IP, containerd_address, kubelet_root, node_dir, node_ip


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


def kubelet_argv(cfg: C.ClusterConfig, i: int) -> list[str]:
    d = node_dir(cfg, i)
    return [str(C.bin_dir("k8s") / "kubelet"), f"--config={d}/kubelet.yaml",
            f"--kubeconfig={cfg.state_dir}/node-kubeconfig", f"--root-dir={kubelet_root(cfg, i)}",
            f"--hostname-override={cfg.nodes[i]}", f"--node-ip={node_ip(cfg, i)}",
            f"--node-labels=sftjob.io/local-node={i}", "--v=1"]
