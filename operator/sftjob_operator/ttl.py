"""TTL after finished: when a finished SFTJob is deleted.

The answer is a time, not a check: the reconciler requeues the job for the exact moment
the TTL runs out, so deletion happens on time instead of at the next unrelated event
(kubeflow/trainer#1533).
"""
from __future__ import annotations

from datetime import datetime, timedelta


def seconds_left(completed: datetime, ttl_seconds: int | None, now: datetime) -> float | None:
    """Seconds until the job must be deleted (<= 0: now); None when it has no TTL."""
    if ttl_seconds is None:
        return None
    return (completed + timedelta(seconds=ttl_seconds) - now).total_seconds()
