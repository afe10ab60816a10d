"""Fake nodes for scale tests: kwok (kubernetes-sigs/kwok) keeps Nodes annotated
`kwok.x-k8s.io/node=fake` Ready and plays their pods' lifecycle (Running, then Succeeded for Job
pods, deletion) without running anything; no kubelet serves them.

Pods land on a fake node only if they tolerate the `kwok.x-k8s.io/node=fake:NoSchedule` taint,
so ordinary test pods keep running on the agent's real nodes.
"""
from __future__ import annotations

import time

from . import cluster, proc
from . import config as C
from .components import start
from .kube import ApiError, Kube

STAGES = ["node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
          "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml"]
TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}


def kwok_up(nodes: int = 10, cfg: C.ClusterConfig | None = None, cpu: str = "32", memory: str = "256Gi",
            pods: str = "110", prefix: str = "kwok-node-") -> list[str]:
    """Start kwok (if not running) and make sure fake nodes PREFIX0..PREFIX{nodes-1} exist and are
    Ready. Returns their names."""
    cfg = cfg or C.load()
    cluster.ensure_binaries(("kwok",))
    home = C.bin_dir("kwok").parent
    if not proc.alive(proc.read_pid(cfg, "kwok"), str(cfg.state_dir)):
        argv = [str(home / "bin" / "kwok"), f"--kubeconfig={cfg.kubeconfig}", "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--node-lease-duration-seconds=40", "--cidr=10.250.0.0/16", f"--node-ip={cfg.host_ip}",
                "--config=" + ",".join(str(home / "stage" / s) for s in STAGES)]
        start(cfg, "kwok", argv)
    kube = Kube.from_state(cfg)
    names = [f"{prefix}{i}" for i in range(nodes)]
    cap = {"cpu": cpu, "memory": memory, "pods": pods}
    for name in names:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                             "labels": {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        "kubernetes.io/arch": "amd64"}},
                "spec": {"taints": [TAINT]},
                "status": {"capacity": cap, "allocatable": cap}}
        try:
            kube.create("/api/v1/nodes", body)
        except ApiError as e:
            if e.status != 409:
                raise
    deadline = time.time() + 120
    for name in names:
        while True:
            conds = kube.get(f"/api/v1/nodes/{name}")["status"].get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                # The API server taints every new Node not-ready; set the fake-node taint in its
                # place at once rather than wait for the node lifecycle controller.
                kube.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": [TAINT]}})
                break
            if time.time() > deadline:
                raise TimeoutError(f"fake node {name} not Ready: see {cfg.logs / 'kwok.log'}")
            time.sleep(0.5)
    return names


def kwok_down(cfg: C.ClusterConfig | None = None) -> None:
    """Stop kwok and delete every fake node (their pods are then garbage-collected)."""
    cfg = cfg or C.load()
    proc.stop(cfg, "kwok")
    kube = Kube.from_state(cfg)
    for n in kube.get("/api/v1/nodes", labelSelector="type=kwok")["items"]:
        try:
            kube.delete(f"/api/v1/nodes/{n['metadata']['name']}")
        except ApiError as e:
            if e.status != 404:
                raise
