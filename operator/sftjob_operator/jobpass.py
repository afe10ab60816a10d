"""The one interface a policy sees of a reconcile pass: what the pass observed, the status it
is building, and the few verbs every policy uses. reconcile.py implements it (and checks that
it does, by type); the policy modules decide and apply against it, so that a policy's rule and
its effect on the job live in one file.

A policy that takes part in the stages of a gang defines some of these functions, and
reconcile.POLICIES lists it once; the stages call them in that order:
- `on_new_gang(p)`: before the pods of a new attempt are built (its size, say);
- `while_starting(p, verdict, current) -> bool`: pods not all running yet; True: it acted,
  and the policies after it are not asked;
- `while_running(p, verdict, current) -> bool`: the gang trains; True as above.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from . import api, builders
from .nodes import NodeLease, NodeReadiness
from .phases import Phase
from .plan import Plan
from .status import SFTJobStatus

Gang = dict[int, dict[str, Any]]   # the current attempt's pods by rank

# How soon a pass asks to be run again, by what it waits for. A running job's progress arrives
# sooner, as the background scraper reads it (progress.Scraper asks for a pass on a change).
PROGRESS_INTERVAL_S = 15.0   # a running job, at least this often
STARTING_POLL_S = 5.0        # a starting gang, besides pod events
STALE_POLL_S = 2.0           # while old pods finish terminating
SETTLE_POLL_S = 2.0          # while a failure waits for a peer node's heartbeat (settle_generic_failure)
QUOTA_RETRY_S = 10.0         # a gang waiting for namespace quota is tried again


class Pass(Protocol):
    # What the pass observed.
    meta: dict[str, Any]
    job: builders.JobRef
    spec: api.SFTJobSpec
    generation: int | None
    pods: list[dict[str, Any]]
    now: datetime
    node_ready: dict[str, NodeReadiness]
    node_leases: dict[str, NodeLease]
    metrics: dict[str, float] | None
    observing_since: datetime | None
    cluster_nodes: list[dict[str, Any]] | None
    queued: bool          # the current gang waits for Kueue's admission
    # What it builds.
    st: SFTJobStatus      # the job's status, edited in place, written once at the end
    plan: Plan

    @property
    def size(self) -> int:
        """Pods in the current gang (an elastic job's size; else resources.nodes)."""
        ...

    def set_phase(self, phase: Phase, reason: str, message: str) -> None: ...

    def event(self, type_: str, reason: str, message: str) -> None: ...

    def reason_changed_to(self, reason: str) -> bool:
        """Whether the Ready condition did not carry `reason` before this pass (an Event for
        a waiting reason is posted once, not every pass)."""
        ...

    def requeue(self, seconds: float) -> None: ...

    def stop(self, pods: list[dict[str, Any]], finished_too: bool = False) -> None: ...

    def fail(self, reason: str, message: str) -> None: ...

    def cleanup_finished(self) -> None:
        """A finished job's pods stop (per cleanPodPolicy) and its TTL runs."""
        ...
