"""Suspend and resume (spec.suspend). Pure; no I/O.

Policy:
- Suspending first asks the running trainer for a checkpoint and waits for it to commit
  (stop_request.py; SIGTERM's checkpoint is the fallback), then stops every pod of the
  job gracefully, finished
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

from . import conditions as c
from . import queueing
from .jobpass import Pass
from .phases import Phase


class Step(enum.Enum):
    NONE = "None"              # not suspended, and not resuming
    SUSPEND = "Suspend"        # spec.suspend just turned true: tear the gang down
    SUSPENDED = "Suspended"    # still suspended: keep the pods gone
    RESUME = "Resume"          # spec.suspend turned false again: start a new gang


def step(phase: str | None, suspend: bool) -> Step:
    """What spec.suspend asks of a job that is not finished, in phase `phase`."""
    if suspend:
        return Step.SUSPENDED if phase == Phase.SUSPENDED else Step.SUSPEND
    return Step.RESUME if phase == Phase.SUSPENDED else Step.NONE


def apply(p: Pass, todo: Step, poll_s: float) -> None:
    """Carry out SUSPEND or SUSPENDED on a reconcile pass `p` (jobpass.Pass): the policy
    above, applied where it is stated."""
    if todo is Step.SUSPEND:
        p.st.attempt += 1
        p.st.start_time = None   # the active deadline starts again on resume
        p.st.restart_after = None
        p.set_phase(Phase.SUSPENDED, c.REASON_SUSPENDED, "pods stopped; they checkpointed on SIGTERM")
        p.event("Normal", c.REASON_SUSPENDED, "suspending: stopping the pods gracefully")
        if c.get_condition(p.st.conditions, queueing.ADMITTED):
            queueing.set_admitted(p, False, c.REASON_SUSPENDED,
                           "suspended: the pods are deleted, which finishes the pod group's Workload "
                           "and releases its quota; resuming queues a new pod group")
    p.stop(p.pods, finished_too=True)
    if any(pod["metadata"].get("deletionTimestamp") for pod in p.pods):
        p.requeue(poll_s)

