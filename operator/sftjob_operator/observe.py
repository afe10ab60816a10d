"""What a reconcile pass reads besides the job and its pods: the Ready state of the nodes of
pending and running pods, the nodes' heartbeats when a rank failed beside running ones, the
trainer's progress (asked of the background scraper, never waited for), and the cluster's
Nodes for a job that may change size. Each is read only when the decision can use it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sftjob_contract.metrics import METRICS_PATH

from . import builders, status
from .nodes import NodeLease, NodeReadiness
from .phases import PodPhase
from .runtime import Runtime
from .workqueue import Key


@dataclass
class Observation:
    node_ready: dict[str, NodeReadiness]
    node_leases: dict[str, NodeLease]
    metrics: dict[str, Any] | None       # rank 0's latest scrape; None: none yet
    cluster_nodes: list[dict[str, Any]] | None   # None: not read (the job cannot resize)


def _phase(pod: dict[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("phase")


def _nodes(pods: list[dict[str, Any]], *phases: str) -> set[str]:
    return {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName") and _phase(p) in phases}


def resizable(body: dict[str, Any]) -> bool:
    """Whether the job may change size (elastic, or running at another size than it wants):
    only then are the cluster's Nodes read for it."""
    res = (body.get("spec") or {}).get("resources") or {}
    nodes, running = res.get("nodes", 1), (body.get("status") or {}).get("nodes")
    return res.get("minNodes", nodes) < nodes or running not in (None, nodes)


async def observe(rt: Runtime, key: Key, body: dict[str, Any], pods: list[dict[str, Any]]) -> Observation:
    attempt = status.parse(body.get("status")).attempt
    gang = [p for p in pods if builders.pod_attempt(p) == attempt]
    nodes = _nodes(pods, PodPhase.PENDING, PodPhase.RUNNING)
    node_ready = await rt.kube.node_ready(nodes) if nodes else {}
    # A rank of the gang failed beside running ones: their nodes' heartbeats tell a failure
    # from the echo of a dead machine (failure_policy.settle_generic_failure). Read only then.
    running_nodes = _nodes(gang, PodPhase.RUNNING)
    failed = any(_phase(p) == PodPhase.FAILED for p in gang)
    leases = await rt.kube.node_leases(running_nodes) if failed and running_nodes else {}
    scraped = None
    rank0 = next((p for p in gang if p["metadata"].get("labels", {}).get(builders.LABEL_RANK) == "0"), None)
    running = rank0 and _phase(rank0) == PodPhase.RUNNING and rank0["status"].get("podIP")
    if rt.scraper is not None and running and rank0 is not None:
        url = f"http://{rank0['status']['podIP']}:{builders.METRICS_PORT}{METRICS_PATH}"
        scraped = rt.scraper.want(key, rank0["metadata"]["uid"], url)
    elif rt.scraper is not None:
        rt.scraper.forget(key)
    cluster_nodes = await rt.kube.list_nodes() if resizable(body) else None
    return Observation(node_ready, leases, scraped, cluster_nodes)
