"""Progress a platform can read: percent done, estimated time remaining, and goodput. Pure.

All of it is derived from the progress readings the operator already takes (progress.py),
so it needs nothing from the trainer and survives operator restarts (it lives in the
status):

- `percent`: step / totalSteps.
- `secondsPerStep`: the measured pace, an exponential average over the readings in which
  the step advanced within one attempt (a restart's gap is not training and is left out,
  so the pace carries through restarts unchanged).
- `estimatedRemainingSeconds`: (totalSteps - step) × secondsPerStep. It does not predict
  future restarts; each one adds its own gap, which goodput shows.
- `trainingSeconds`: wall time covered by readings in which the step advanced within one
  attempt: time spent training.
- `stepsLost`: steps trained and then lost to restarts (the step a new attempt resumes at,
  below the highest step seen before).
- `goodput`: trainingSeconds over the wall time since the job was created (queueing,
  start-up, restarts and lost steps are what brings it below 1).
"""
from __future__ import annotations

from datetime import datetime

from .status import Progress, parse_time

PACE_WEIGHT = 0.3   # weight of the newest pace sample in the running average


def update(before: Progress, after: Progress, attempt: int, now: datetime, created: datetime | None) -> Progress:
    """`after` (a merged reading) with percent, pace, ETA and goodput brought up to date;
    `before` is the progress before the reading, `attempt` the gang that produced it."""
    out = after.model_copy()
    step, total = after.step, after.total_steps
    same_attempt = before.reading_attempt == attempt
    last_advance = parse_time(before.last_step_time)
    if same_attempt and step is not None and before.step is not None and step > before.step and last_advance:
        seconds = max(0.0, (now - last_advance).total_seconds())
        sample = seconds / (step - before.step)
        pace = before.seconds_per_step
        out.seconds_per_step = round(sample if pace is None else pace + PACE_WEIGHT * (sample - pace), 3)
        out.training_seconds = round((before.training_seconds or 0.0) + seconds, 1)
    if not same_attempt and before.step is not None and step is not None and step < before.step:
        out.steps_lost = (before.steps_lost or 0) + before.step - step
    out.reading_attempt = attempt
    if step is not None and total:
        out.percent = round(100.0 * min(step, total) / total, 1)
        if out.seconds_per_step is not None:
            out.estimated_remaining_seconds = int(round(max(0, total - step) * out.seconds_per_step))
    if created is not None and out.training_seconds:
        wall = (now - created).total_seconds()
        out.goodput = round(min(1.0, out.training_seconds / wall), 3) if wall > 0 else None
    return out


def finished(progress: Progress) -> Progress:
    """A job that succeeded: all done, nothing remaining."""
    return progress.model_copy(update={"percent": 100.0, "estimated_remaining_seconds": 0})
