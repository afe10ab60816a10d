"""What one reconcile pass decided (reconcile.py) and act.py carries out (act.apply_plan).

A plan is data, so that the decision can be tested without a cluster: the status to
write, the pods to create or delete, the events to post and when to look again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .phases import RestartCause
from .status import SFTJobStatus, dump


@dataclass
class Event:
    type: str   # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    """What one reconcile pass decided. The handler applies it in field order."""

    new_status: SFTJobStatus | None = None        # the whole new status, None when unchanged
    launch: list[dict[str, Any]] = field(default_factory=list)   # pods to create
    launched_status: dict[str, Any] | None = None  # merged into status once `launch` all exist
    delete_pods: list[str] = field(default_factory=list)
    force_delete_pods: list[str] = field(default_factory=list)   # grace period 0: their node is lost
    delete_job: bool = False
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    restart_cause: RestartCause | None = None   # for metrics
    checkpoint_hold_s: float | None = None   # ask rank 0 to checkpoint now, then hold this long (stop_request.py)
    invalid: str | None = None         # set when the spec cannot run: the handler raises PermanentError

    @property
    def status(self) -> dict[str, Any] | None:
        """The new status in its wire form (camelCase), None when unchanged."""
        return dump(self.new_status) if self.new_status is not None else None
