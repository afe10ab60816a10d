"""Node loss and pod logs on the real nodes.

node_lost() makes a node vanish the way a machine does: its kubelet is killed (no more status,
no more lease) and every container of the node is SIGKILLed through its containerd. The
controller manager then marks the Node Ready=Unknown and taints it unreachable, exactly as on a
production cluster. node_restore() starts the kubelet again; it re-registers, finds its old
sandboxes dead and reports the pods it still owns.
"""
from __future__ import annotations

import time

from . import config as C
from . import proc
from . import realnodes as R
from .components import start_component
from .kube import ApiError, Kube


def _ready(kube: Kube, node: str) -> str:
    conds = kube.get(f"/api/v1/nodes/{node}")["status"].get("conditions") or []
    return next((c["status"] for c in conds if c["type"] == "Ready"), "")


def _index(cfg: C.ClusterConfig, node: str) -> int:
    if node not in cfg.nodes:
        raise ValueError(f"{node} is not a node of this cluster (nodes: {', '.join(cfg.nodes)})")
    return cfg.nodes.index(node)


def node_lost(node: str, delete_pods: bool = False, cfg: C.ClusterConfig | None = None, timeout: float = 90,
              kill_containers: bool = True) -> None:
    """Kill NODE's kubelet and (kill_containers) every container on it, as a machine that dies;
    without kill_containers the containers run on, unsupervised, as behind a stopped kubelet
    or a network partition. Returns once the Node is NotReady (Ready Unknown, after the
    controller manager's grace period). With delete_pods its pods are then force-deleted, as
    the pod garbage collector eventually does. The Node carries C.LOST_ANNOTATION meanwhile, so
    observers can tell a simulated loss from a real failure."""
    cfg = cfg or C.load()
    i = _index(cfg, node)
    kube = Kube.from_state(cfg)
    kube.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {C.LOST_ANNOTATION: "true"}}})
    proc.kill_component(cfg, f"kubelet-{i}")
    if kill_containers:
        R.stop_pods(cfg, i)
    deadline = time.time() + timeout
    while _ready(kube, node) == "True":
        if time.time() > deadline:
            raise TimeoutError(f"node {node} still Ready {timeout}s after its kubelet was killed: "
                               "is kube-controller-manager's node-lifecycle-controller running?")
        time.sleep(0.5)
    if delete_pods:
        pods = kube.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")["items"]
        for p in pods:
            md = p["metadata"]
            try:
                kube.delete(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}", {"gracePeriodSeconds": 0})
            except ApiError as e:
                if e.status != 404:
                    raise


def node_restore(node: str, cfg: C.ClusterConfig | None = None, timeout: float = 90) -> None:
    """Start a lost NODE's kubelet again and wait until the Node is Ready and free of the node
    controller's taints (a cordon stays: uncordoning is the caller's business)."""
    cfg = cfg or C.load()
    i = _index(cfg, node)
    kube = Kube.from_state(cfg)
    start_component(cfg, f"kubelet-{i}")
    deadline = time.time() + timeout
    while True:
        n = kube.get(f"/api/v1/nodes/{node}")
        # The node controller's health taints; a cordon's `unschedulable` one is a user's choice, not health.
        taints = [t for t in n["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")
                  and t["key"] != "node.kubernetes.io/unschedulable"]
        if _ready(kube, node) == "True" and not taints:
            break
        if time.time() > deadline:
            raise TimeoutError(f"node {node} not Ready and untainted {timeout}s after its kubelet restarted")
        time.sleep(0.5)
    kube.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {C.LOST_ANNOTATION: None}}})


def pod_log(namespace: str, pod: str, container: str | None = None, cfg: C.ClusterConfig | None = None,
            previous: bool = False) -> str:
    """A container's log as `kubectl logs` returns it (from the pod's kubelet), or "" when the
    pod, its container or its node is gone."""
    kube = Kube.from_state(cfg or C.load())
    params = {"container": container} if container else {}
    if previous:
        params["previous"] = "true"
    try:
        return kube.text(f"/api/v1/namespaces/{namespace}/pods/{pod}/log", **params)
    except (ApiError, OSError):
        return ""
