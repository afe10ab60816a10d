"""Node-loss simulation, driven through the API: the node agent watches the annotation."""
from __future__ import annotations

import time

from . import config as C
from .kube import ApiError, Kube


def _ready(kube: Kube, node: str) -> str:
    conds = kube.get(f"/api/v1/nodes/{node}")["status"].get("conditions") or []
    return next((c["status"] for c in conds if c["type"] == "Ready"), "")


def node_lost(node: str, delete_pods: bool = False, cfg: C.ClusterConfig | None = None, timeout: float = 60) -> None:
    """Make NODE vanish as a machine would: its pods' processes are SIGKILLed, the pods go Failed
    (reason NodeLost, condition DisruptionTarget), the Node reports Ready=Unknown and gets the
    node.kubernetes.io/unreachable taints. With delete_pods the pods are then force-deleted, as
    the pod garbage collector eventually does. Returns once the Node is NotReady."""
    cfg = cfg or C.load()
    kube = Kube.from_state(cfg)
    kube.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {C.LOST_ANNOTATION: "true"}}})
    deadline = time.time() + timeout
    while _ready(kube, node) == "True":
        if time.time() > deadline:
            raise TimeoutError(f"node {node} still Ready after {timeout}s: is the node agent running?")
        time.sleep(0.3)
    if delete_pods:
        pods = kube.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")["items"]
        for p in pods:
            md = p["metadata"]
            try:
                kube.delete(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}", {"gracePeriodSeconds": 0})
            except ApiError as e:
                if e.status != 404:
                    raise


def node_restore(node: str, cfg: C.ClusterConfig | None = None, timeout: float = 60) -> None:
    """Bring a lost NODE back: Ready again, taints removed, schedulable."""
    cfg = cfg or C.load()
    kube = Kube.from_state(cfg)
    kube.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {C.LOST_ANNOTATION: None}}})
    deadline = time.time() + timeout
    while _ready(kube, node) != "True":
        if time.time() > deadline:
            raise TimeoutError(f"node {node} not Ready after {timeout}s")
        time.sleep(0.3)
