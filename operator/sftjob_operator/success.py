"""Success policy: when an SFTJob has succeeded, and what its status says then. Pure.

Policy: the job succeeds when every rank of its current gang has exited 0
(`failure_policy.judge_gang`). A rank that is done while its peers still run counts as
running, and a rank lost at the end (deleted, preempted) as a preemption, so the gang
restarts from its checkpoint rather than succeeding with a missing rank. Success is final:
the job's running pods stop, finished ones are cleaned per runPolicy.cleanPodPolicy, and
the TTL (ttl.py) starts.

What the status says: `output.uri` names the exported model, `completionTime` is set, and
`progress` shows the run complete. The last progress reading may predate the final steps
(progress is scraped every few seconds), so the step is set to the run's total. A run the
trainer stopped early (validation loss no longer improving, `training.earlyStoppingPatience`)
succeeds with reason `EarlyStopped` and rank 0's account of why; its step stays where it stopped.
"""
from __future__ import annotations

from typing import Any

from sftjob_contract import exits

from . import builders, eta
from . import conditions as c
from . import progress as prog
from .failure_policy import parse_termination_message, terminated_state
from .jobpass import Gang, Pass
from .phases import Phase
from .status import Progress, iso

REASON_EARLY_STOPPED = exits.REASON_EARLY_STOPPED


def early_stop(current: dict[int, dict[str, Any]]) -> str | None:
    """Rank 0's account of an early stop (its termination message), or None."""
    term = terminated_state(current[0]) if 0 in current else None
    reason, detail = parse_termination_message((term or {}).get("message"))
    return detail if reason == REASON_EARLY_STOPPED else None


def apply(p: Pass, verdict: object, current: Gang) -> None:
    """The job succeeded (every rank exited 0): say so on the reconcile pass `p`."""
    uri = p.st.output.uri or builders.model_uri(p.job, p.spec)   # the gang's, set at launch
    p.st.output.uri = uri
    p.st.completion_time = iso(p.now)
    early = early_stop(current)
    p.st.progress = eta.finished(p.st.progress if early else final_progress(p.st.progress))
    reason, message = (REASON_EARLY_STOPPED, early) if early else (c.REASON_SUCCEEDED, f"model exported to {uri}")
    p.set_phase(Phase.SUCCEEDED, reason, message)
    p.event("Normal", reason, f"every rank exited 0; {message}")
    p.cleanup_finished()


def final_progress(progress: Progress) -> Progress:
    """status.progress of a job that succeeded: at its last step when the total is known."""
    if not progress.total_steps:
        return progress
    return progress.model_copy(update={"step": progress.total_steps,
                                       "summary": prog.summary(progress.total_steps, progress.total_steps)})
