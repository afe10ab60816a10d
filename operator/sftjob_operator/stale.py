"""Pods of an earlier gang attempt: the next gang waits for them. Pure; no I/O.

Policy: an earlier gang is stopped (its pods checkpoint on SIGTERM) and the next gang is
created only once every one of its pods is gone, so two gangs never train into the same
checkpoints. A pod whose node is lost cannot finish terminating by itself (no kubelet
confirms it), so once its grace period has been over for FORCE_DELETE_AFTER_S while its
node is not ready, it is force-deleted (grace period 0). Otherwise the job says which pod
it waits for.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .failure_policy import NodeReadiness, node_ready_for
from .status import parse_time

FORCE_DELETE_AFTER_S = 30.0  # past its grace period, a pod on a NotReady node is force-deleted


@dataclass(frozen=True)
class Lingering:
    """A stale pod whose grace period is over: force-delete it, or say that the job waits."""

    pod: str
    force_delete: bool
    message: str


def lingering(stale: list[dict[str, Any]], node_ready: dict[str, NodeReadiness], now: datetime) -> list[Lingering]:
    """The stale pods still there after their grace period, and what to do about each."""
    out = []
    for pod in stale:
        meta, node = pod["metadata"], (pod.get("spec") or {}).get("nodeName", "")
        deadline = parse_time(meta.get("deletionTimestamp"))
        if deadline is None or now < deadline:
            continue
        where = f"node {node}" if node else "no node"
        over = (now - deadline).total_seconds()
        if node_ready_for(pod, node_ready.get(node)) is False and over >= FORCE_DELETE_AFTER_S:
            out.append(Lingering(meta["name"], True,
                                 f"pod {meta['name']} was still terminating on {where}, which is not ready, "
                                 f"{over:.0f}s after its grace period; force-deleted so that the gang can restart"))
        else:
            out.append(Lingering(meta["name"], False,
                                 f"waiting for pod {meta['name']} of an earlier attempt to terminate on {where} "
                                 f"(its grace period ended at {meta['deletionTimestamp']})"))
    return out
