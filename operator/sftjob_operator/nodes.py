"""What the operator reads of a node to judge the pods on it: its Ready condition and its
heartbeat (failure_policy.py and stale.py decide with them; kube.py reads them)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class NodeReadiness:
    """A node's Ready condition as last read: `ready` (Unknown reads as not ready) and the
    condition's lastTransitionTime (`since`, None when unknown)."""

    ready: bool
    since: datetime | None = None


@dataclass(frozen=True)
class NodeLease:
    """A node's heartbeat: the Lease its kubelet renews every `duration_s` / 4 seconds."""

    renewed: datetime
    duration_s: float
