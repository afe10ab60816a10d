"""The run policy's three clocks: active, startup and progress deadlines. Pure; no I/O.

Each answer is the seconds left (<= 0: the deadline has passed) or None (no deadline runs),
so that the reconciler fails or restarts the job the moment a deadline passes and
otherwise asks to be looked at again exactly then, as for the TTL (ttl.py).

- Active deadline (runPolicy.activeDeadlineSeconds): counted from status.startTime, when
  all pods of the job first ran. Suspending clears startTime, so the clock starts again on
  resume (as for a batch/v1 Job). Checked before anything else waits, so a gang stuck
  terminating ends at the deadline too.
- Startup deadline (runPolicy.startupDeadlineSeconds): from the creation of the current
  gang's pods to all of them running. Time queued in Kueue does not count: once Kueue has
  admitted the gang, the clock starts at the admission. While the API server refuses the
  pods (a full namespace quota), it counts from when the job last stopped being Ready.
- Progress deadline (runPolicy.progressDeadlineSeconds, the hang watchdog): from the last
  time status.progress.step advanced. Armed only once the step advanced during the current
  attempt (a long model load or data scan is not a hang) and disarmed after the last step
  (final validation and export may legitimately take long). It counts only what this
  operator process could see: after an operator start or a leader change the clock runs
  from the later of the last step and the moment this process began observing, so an
  operator outage longer than the deadline restarts no healthy gang (the step time stored
  before the outage says nothing about the minutes nobody was watching).
"""
from __future__ import annotations

from datetime import datetime, timedelta

from . import conditions as c
from . import failure_policy as fp
from . import restarts
from .jobpass import Gang, Pass
from .status import parse_time


def _left(since: datetime, seconds: int, now: datetime) -> float:
    return (since + timedelta(seconds=seconds) - now).total_seconds()


def active_left(started: datetime | None, limit: int | None, now: datetime) -> float | None:
    """Seconds until the active deadline; None before the job first ran or without one."""
    if started is None or not limit:
        return None
    return _left(started, limit, now)


def startup_since(launched: datetime, admitted_at: datetime | None) -> tuple[datetime, str]:
    """When the startup clock of a launched gang started, and what started it: the pods'
    creation, or Kueue's admission when that came later (queued time is not start-up)."""
    if admitted_at is not None and admitted_at > launched:
        return admitted_at, "admission by Kueue"
    return launched, "creation"


def startup_left(since: datetime, limit: int, now: datetime) -> float:
    """Seconds until the startup deadline of a gang whose clock started at `since`."""
    return _left(since, limit, now)


def progress_left(limit: int | None, last_step: datetime | None, launched: datetime | None,
                  step: int | None, total: int | None, now: datetime,
                  observing_since: datetime | None = None) -> float | None:
    """Seconds until the watchdog restarts a gang whose step stopped advancing; None while
    it is not armed (no limit, no step yet in this attempt, or the last step is done).
    `observing_since`: when this operator process started watching (None: always)."""
    if not limit or last_step is None or launched is None or last_step < launched:
        return None
    if total and step and step >= total:
        return None
    since = max(last_step, observing_since) if observing_since is not None else last_step
    return _left(since, limit, now)


# -- applied on a reconcile pass (jobpass.Pass), where the policy is stated ------------------

def active(p: Pass) -> bool:
    """The active deadline: True when it has passed and the job failed; else the pass is
    asked for again when it would pass."""
    rp = p.spec.run_policy
    left = active_left(parse_time(p.st.start_time), rp.active_deadline_seconds, p.now)
    if left is None:
        return False
    if left <= 0:
        p.fail(c.REASON_DEADLINE, f"runPolicy.activeDeadlineSeconds ({rp.active_deadline_seconds}) exceeded")
        return True
    p.requeue(left)
    return False


def while_running(p: Pass, verdict: fp.GangVerdict, current: Gang) -> bool:
    """The watchdog: restart a gang whose step stopped advancing (a rank stuck in a
    collective, say), when it is armed (progress_left). True if it restarted."""
    limit = p.spec.run_policy.progress_deadline_seconds
    progress = p.st.progress
    left = progress_left(limit, parse_time(progress.last_step_time), parse_time(p.st.launch_time),
                         progress.step, progress.total_steps, p.now, p.observing_since)
    if left is None:
        return False
    if left > 0:
        p.requeue(left)
        return False
    stuck = fp.GangVerdict(fp.Verdict.RESTART_FAILED, c.REASON_PROGRESS_DEADLINE,
                           f"step {progress.step} has not advanced for {limit}s "
                           "(runPolicy.progressDeadlineSeconds); a rank may be stuck")
    restarts.after_failure(p, stuck, current, reason=c.REASON_PROGRESS_DEADLINE)
    return True
