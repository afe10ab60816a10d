"""Restarts: what a failed or preempted gang costs, and how the next attempt starts. Pure; no I/O.

Policy: the whole gang restarts, never a single rank (the ranks of an attempt share one
rendezvous and one step). A failure spends runPolicy.backoffLimit and a preemption
runPolicy.preemptionLimit, counted apart (status.restarts); once a limit is spent the job
fails naming it. The next attempt starts after failure_policy.restart_delay (exponential from
runPolicy.restartBackoffSeconds), and its pods are built only when every pod of this one is
gone (stale.py).
"""
from __future__ import annotations

from datetime import timedelta

from . import conditions as c
from . import failure_policy as fp
from .jobpass import STALE_POLL_S, Gang, Pass
from .phases import Phase, RestartCause
from .status import iso


def failed(p: Pass, verdict: fp.GangVerdict, current: Gang) -> None:
    """The trainer said no retry can help (exit 2): the job fails."""
    p.fail(verdict.reason, f"{verdict.message} (a deterministic error: the trainer exited 2, and "
           "retrying cannot help; fix the spec or the data and create the job again)")


def after_failure(p: Pass, verdict: fp.GangVerdict, current: Gang, reason: str | None = None) -> None:
    """A failed attempt: restart the gang, or fail the job when backoffLimit is spent."""
    rp = p.spec.run_policy
    failures = p.st.restarts.failures
    if failures >= rp.backoff_limit:
        p.fail(verdict.reason or c.REASON_BACKOFF_LIMIT,
               f"{c.REASON_BACKOFF_LIMIT}: {failures + 1} failed attempts "
               f"(runPolicy.backoffLimit {rp.backoff_limit}); last: {verdict.message}")
    else:
        restart(p, RestartCause.FAILURE, verdict, current, reason)


def after_preemption(p: Pass, verdict: fp.GangVerdict, current: Gang) -> None:
    """A preempted attempt: restart the gang, or fail the job when preemptionLimit is spent."""
    rp = p.spec.run_policy
    if p.st.restarts.preemptions >= rp.preemption_limit:
        p.fail(c.REASON_PREEMPTION_LIMIT,
               f"{c.REASON_PREEMPTION_LIMIT}: runPolicy.preemptionLimit ({rp.preemption_limit}) "
               f"reached; last: {verdict.message}")
    else:
        restart(p, RestartCause.PREEMPTION, verdict, current)


def restart(p: Pass, cause: RestartCause, verdict: fp.GangVerdict, current: Gang, reason: str | None = None) -> None:
    delay = fp.restart_delay(p.spec.run_policy.restart_backoff_seconds, p.st.restarts.total)
    p.st.restarts.count(cause)
    p.st.attempt += 1
    p.st.restart_after = iso(p.now + timedelta(seconds=delay))
    reason = reason or (c.REASON_RESTART_FAILURE if cause == RestartCause.FAILURE else c.REASON_RESTART_PREEMPTION)
    message = (f"{verdict.reason}: {verdict.message}; restarting the whole gang in {delay:.0f}s "
               f"(attempt {p.st.attempt})")
    p.set_phase(Phase.RESTARTING, reason, message)
    p.event("Warning", reason, message)
    p.plan.restart_cause = cause
    p.stop(list(current.values()), finished_too=True)
    p.requeue(max(delay, STALE_POLL_S))
