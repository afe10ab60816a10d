"""Pods of an earlier gang attempt: the next gang waits for them. Pure; no I/O.

Policy: an earlier gang is stopped (its pods checkpoint on SIGTERM) and the next gang is
created only once every one of its pods is gone: the pod names are reused, and a pod that
still runs may still be checkpointing. A pod whose node is lost (not ready, as held against
the pod) cannot finish terminating by itself: no kubelet is there to run its SIGTERM or to
confirm it. Waiting out its grace period buys nothing, so once its deletion is requested it
is force-deleted (grace period 0). What keeps a trainer still running there (a partition
rather than a dead machine) from harming the job is fencing, not the wait: the new attempt
claims the output, and a stale rank cannot commit, prune or export (trainer fence.py). The
wait used to be the grace period plus 30 s, about 60 s of every shrink on a lost node
(measured by `make chaos`'s restart-gap breakdown). Otherwise the job says which pod it
waits for.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .failure_policy import node_ready_for
from .nodes import NodeReadiness
from . import conditions as c
from .jobpass import STALE_POLL_S, Pass
from .phases import Phase
from .status import parse_time


@dataclass(frozen=True)
class Lingering:
    """A stale pod on a lost node (force-delete it) or past its grace period (say that the job waits)."""

    pod: str
    force_delete: bool
    message: str


def lingering(stale: list[dict[str, Any]], node_ready: dict[str, NodeReadiness], now: datetime) -> list[Lingering]:
    """The stale pods that need a word or a force-delete, and which."""
    out = []
    for pod in stale:
        meta, node = pod["metadata"], (pod.get("spec") or {}).get("nodeName", "")
        deadline = parse_time(meta.get("deletionTimestamp"))
        if deadline is None:
            continue
        where = f"node {node}" if node else "no node"
        if node_ready_for(pod, node_ready.get(node)) is False:
            out.append(Lingering(meta["name"], True,
                                 f"pod {meta['name']} was terminating on {where}, which is not ready, so no kubelet "
                                 f"can end it; force-deleted so that the gang can restart (a trainer still running "
                                 f"there is fenced off the output)"))
        elif now < deadline:
            continue
        else:
            out.append(Lingering(meta["name"], False,
                                 f"waiting for pod {meta['name']} of an earlier attempt to terminate on {where} "
                                 f"(its grace period ended at {meta['deletionTimestamp']})"))
    return out


# -- applied on a reconcile pass (jobpass.Pass), where the policy is stated ------------------

def wait(p: Pass, old_gang: list[dict[str, Any]]) -> None:
    """Stop an earlier gang and wait for it: force-delete its pods on lost nodes, and say
    which pod the job waits for."""
    p.stop(old_gang, finished_too=True)
    p.requeue(STALE_POLL_S)
    for pod in lingering(old_gang, p.node_ready, p.now):
        if pod.force_delete and pod.pod not in p.plan.force_delete_pods:
            p.plan.force_delete_pods.append(pod.pod)
            p.event("Warning", c.REASON_FORCE_DELETED, pod.message)
        elif not pod.force_delete and p.st.phase in (Phase.PENDING, Phase.RESTARTING):
            p.set_phase(p.st.phase, c.REASON_TERMINATING, pod.message)
