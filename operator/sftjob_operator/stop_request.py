"""A planned stop checkpoints first. Pure; the handler sends the request (handlers.py).

Policy:
- A stop the operator chooses (a suspend, a resize of a running gang) first asks rank 0's
  trainer to checkpoint now (`POST /checkpoint` on its metrics port, trainer/control.py),
  and deletes the pods only once the scraped `lastCheckpointStep` reaches the step the
  trainer reported when asked. The trainer holds (trains no further step) after that
  checkpoint, so the SIGTERM that follows finds it committed: the stop loses no step, and
  spends none of the grace period (runPolicy.terminationGracePeriodSeconds) writing.
- Nothing is asked when there is nothing to lose: no reading from rank 0 (not started,
  not serving yet), or the newest checkpoint is already at the current step.
- The stop never waits long: when the checkpoint has not committed WAIT_S after the
  request, or the request did not reach the trainer, the pods are stopped anyway and
  checkpoint on SIGTERM as before. An Event says which way it went.
- A stop the operator does not choose (a failure, a preemption by the cluster, a lost
  node, the job's deletion) is not delayed: there it is SIGTERM's checkpoint, or the
  newest periodic one.
"""
from __future__ import annotations


from .jobpass import Pass
from .status import CheckpointRequest, iso, parse_time

WAIT_S = 60.0        # longest wait for the requested checkpoint before stopping anyway
HOLD_S = WAIT_S + 60.0   # how long the trainer waits, checkpointed, for the SIGTERM (then trains on)
POLL_S = 1.0

REASON_REQUESTED = "CheckpointRequested"
REASON_DONE = "CheckpointedBeforeStop"
REASON_NOT_DONE = "CheckpointRequestUnanswered"


def ready_to_stop(p: Pass, why: str) -> bool:
    """On a reconcile pass `p` (jobpass.Pass) about to stop the gang for a planned reason
    `why`: True when it may stop the pods now; False when it asked for a checkpoint (the
    plan carries the request) or still waits for one (a pass is requeued)."""
    st, reading = p.st, p.metrics or {}
    req = st.checkpoint_request if st.checkpoint_request and st.checkpoint_request.attempt == st.attempt else None
    committed = reading.get("lastCheckpointStep")
    if req is None:
        step = reading.get("step")
        if not reading.get("totalSteps") or step is None or (committed is not None and committed >= step):
            st.checkpoint_request = None
            return True
        st.checkpoint_request = CheckpointRequest(attempt=st.attempt, step=int(step), time=iso(p.now), reason=why)
        p.plan.checkpoint_hold_s = HOLD_S
        p.event("Normal", REASON_REQUESTED, f"{why}: asked the trainer to checkpoint (at step {int(step)}) before "
                "the pods are stopped")
        p.requeue(POLL_S)
        return False
    if committed is not None and committed >= req.step:
        p.event("Normal", REASON_DONE, f"checkpoint step-{int(committed)} committed on request; stopping the pods "
                f"({req.reason})")
        st.checkpoint_request = None
        return True
    waited = (p.now - (parse_time(req.time) or p.now)).total_seconds()
    if req.failed or waited >= WAIT_S:
        cause = f"the request did not reach the trainer ({req.failed})" if req.failed else \
            f"no checkpoint at or past step {req.step} committed within {WAIT_S:.0f}s"
        p.event("Warning", REASON_NOT_DONE, f"{cause}; stopping the pods anyway: they checkpoint on SIGTERM within "
                "runPolicy.terminationGracePeriodSeconds")
        st.checkpoint_request = None
        return True
    p.requeue(min(POLL_S, WAIT_S - waited))
    return False
