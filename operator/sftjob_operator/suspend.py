"""Suspend and resume (spec.suspend). Pure; no I/O.

Policy:
- Suspending stops every pod of the job gracefully (each checkpoints on SIGTERM), finished
  ones too, and counts as tearing the gang down: the attempt grows, so that pods of the
  old gang are never taken for the next one. It is neither a failure nor a preemption
  (no restart is counted, no back-off applies: restartAfter is cleared).
- startTime is cleared, so the active deadline starts again on resume, as for a
  batch/v1 Job.
- A gang queued by Kueue loses its admission: deleting the pods finishes the pod group's
  Workload and releases its quota; resuming queues a new pod group.
- Resuming sets the job Pending and launches a new gang, which resumes from the newest
  checkpoint.
- A finished job (Succeeded, Failed) is neither suspended nor resumed.
"""
from __future__ import annotations

import enum


class Step(enum.Enum):
    NONE = "None"              # not suspended, and not resuming
    SUSPEND = "Suspend"        # spec.suspend just turned true: tear the gang down
    SUSPENDED = "Suspended"    # still suspended: keep the pods gone
    RESUME = "Resume"          # spec.suspend turned false again: start a new gang


def step(phase: str | None, suspend: bool) -> Step:
    """What spec.suspend asks of a job that is not finished, in phase `phase`."""
    if suspend:
        return Step.SUSPENDED if phase == "Suspended" else Step.SUSPEND
    return Step.RESUME if phase == "Suspended" else Step.NONE
