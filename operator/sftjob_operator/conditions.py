"""Condition types, reason constants and the one function that sets a condition.

Conditions follow metav1.Condition: `lastTransitionTime` changes only when the status
flips, so rewriting the same condition every pass is a no-op. `Ready` is the summary that
generic tools read; `Reconciling` and `Stalled` are the abnormal-true conditions kstatus
(Argo CD, Flux, `kubectl wait`) understands: Reconciling while pods start or restart,
Stalled once the job has failed.
"""
from __future__ import annotations

from sftjob_contract import exits

from .phases import Phase
from .status import Condition, ConditionStatus

# Types.
READY = "Ready"
RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
RECONCILING = "Reconciling"
STALLED = "Stalled"
EDIT_PENDING = "EditPending"   # a spec edit waits for the gang's next start (edits.py)
ALL_TYPES = (READY, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED, RECONCILING, STALLED, EDIT_PENDING)

# Reasons.
REASON_CREATED = "Created"
REASON_PODS_STARTING = "PodsStarting"
REASON_ALL_RUNNING = "AllPodsRunning"
REASON_NOT_RUNNING = "NotRunning"
REASON_SUCCEEDED = "TrainingSucceeded"
REASON_PREEMPTED = exits.REASON_PREEMPTED          # the trainer's word, and the operator's
REASON_POD_DELETED = "PodDeleted"
REASON_POD_LOST = "PodLost"
REASON_SIGNALLED = "Signalled"
REASON_CRASHED = "Crashed"
REASON_NODE_NOT_READY = "NodeNotReady"
REASON_NODE_LEASE_EXPIRED = "NodeLeaseExpired"
REASON_TRAINING_ERROR = exits.REASON_TRAINING_ERROR  # a failed pod that named no reason
REASON_BACKOFF_LIMIT = "BackoffLimitExceeded"
REASON_PREEMPTION_LIMIT = "PreemptionLimitExceeded"
REASON_DEADLINE = "DeadlineExceeded"
REASON_STARTUP_DEADLINE = "StartupDeadlineExceeded"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_SUSPENDED = "JobSuspended"
REASON_RESUMED = "JobResumed"
REASON_RESTART_PREEMPTION = "RestartingAfterPreemption"
REASON_RESTART_FAILURE = "RestartingAfterFailure"
REASON_INVALID_CONFIG = exits.REASON_INVALID_CONFIG  # ... that exited PERMANENT
REASON_POD_REJECTED = "PodRejected"                  # the API server refused to create a pod
REASON_OBJECT_REJECTED = "ObjectRejected"            # ... the job's Service or ConfigMap
REASON_NAME_TAKEN = "NameTaken"                      # a Service/ConfigMap name held by someone else
REASON_QUOTA_EXCEEDED = "QuotaExceeded"
REASON_PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
REASON_TERMINATING = "WaitingForPodsToTerminate"
REASON_FORCE_DELETED = "ForceDeletedPod"
REASON_INVALID_STATUS = "InvalidStatus"
REASON_WAITS_FOR_RESTART = "WaitsForRestart"        # EditPending: the running gang has the older spec
REASON_EDIT_APPLIED = "EditApplied"              # Event only: this version cannot read the status

MAX_MESSAGE = 2000


def set_condition(conds: list[Condition], ctype: str, status: bool | ConditionStatus, reason: str,
                  message: str, now: str, generation: int | None = None) -> list[Condition]:
    """Return `conds` with condition `ctype` set; lastTransitionTime kept unless status flips."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    old = get_condition(conds, ctype)
    since = old.last_transition_time if old and old.status == value else now
    new = Condition(type=ctype, status=value, reason=reason, message=message[:MAX_MESSAGE],
                    last_transition_time=since, observed_generation=generation)
    order = {t: i for i, t in enumerate(ALL_TYPES)}
    return sorted([x for x in conds if x.type != ctype] + [new], key=lambda x: order.get(x.type, len(order)))


def get_condition(conds: list[Condition], ctype: str) -> Condition | None:
    return next((x for x in conds if x.type == ctype), None)


def for_phase(conds: list[Condition], phase: str, reason: str, message: str, now: str,
              generation: int | None) -> list[Condition]:
    """All condition types derived from one phase (each pass writes the full set)."""
    active = {
        RUNNING: phase == Phase.RUNNING,
        RESTARTING: phase == Phase.RESTARTING,
        SUSPENDED: phase == Phase.SUSPENDED,
        SUCCEEDED: phase == Phase.SUCCEEDED,
        FAILED: phase == Phase.FAILED,
        RECONCILING: phase in (Phase.PENDING, Phase.RESTARTING),
        STALLED: phase == Phase.FAILED,
        READY: phase in (Phase.RUNNING, Phase.SUCCEEDED),
    }
    for ctype, on in active.items():
        # Every condition carries the phase's reason; the message goes on the true ones and
        # on Ready, the summary a user reads first.
        text = message if on or ctype == READY else ""
        conds = set_condition(conds, ctype, on, reason, text, now, generation)
    return conds
