"""Success policy: when an SFTJob has succeeded, and what its status says then. Pure.

Policy: the job succeeds when every rank of its current gang has exited 0
(`failure_policy.judge_gang`). A rank that is done while its peers still run counts as
running, and a rank lost at the end (deleted, preempted) as a preemption, so the gang
restarts from its checkpoint rather than succeeding with a missing rank. Success is final:
the job's running pods stop, finished ones are cleaned per runPolicy.cleanPodPolicy, and
the TTL (ttl.py) starts.

What the status says: `output.uri` names the exported model, `completionTime` is set, and
`progress` shows the run complete. The last progress reading may predate the final steps
(progress is scraped every few seconds), so the step is set to the run's total.
"""
from __future__ import annotations

from . import progress as prog
from .status import Progress


def final_progress(progress: Progress) -> Progress:
    """status.progress of a job that succeeded: at its last step when the total is known."""
    if not progress.total_steps:
        return progress
    return progress.model_copy(update={"step": progress.total_steps,
                                       "summary": prog.summary(progress.total_steps, progress.total_steps)})
