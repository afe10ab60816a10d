"""Percent, ETA and goodput (eta.py), and their path through the planner across a restart."""
from __future__ import annotations

import pytest

from sftjob_operator import eta, reconcile
from sftjob_operator.status import Progress, iso

from .op_testkit import apply, at, pods_for, running_job, terminated

pytestmark = pytest.mark.unit


def _reading(step: int, when: float, attempt: int, **kw) -> Progress:
    return Progress(step=step, total_steps=100, last_step_time=iso(at(when)), reading_attempt=attempt, **kw)


@pytest.mark.parametrize("before, step, now, attempt, want", [
    # 10 steps in 20 s: 2 s a step; 80 left -> 160 s; 20 s of training in 100 s since creation
    (_reading(10, 80, 0), 20, 100, 0,
     {"percent": 20.0, "seconds_per_step": 2.0, "estimated_remaining_seconds": 160, "training_seconds": 20.0,
      "goodput": 0.2}),
    # the pace is averaged: a 4 s/step sample moves 2.0 by 30 % to 2.6
    (_reading(20, 100, 0, seconds_per_step=2.0, training_seconds=20.0), 25, 120, 0,
     {"seconds_per_step": 2.6, "estimated_remaining_seconds": 195, "training_seconds": 40.0}),
    # a new attempt's first reading: no pace sample across the restart gap; the steps redone are lost
    (_reading(30, 100, 0, seconds_per_step=2.0, training_seconds=60.0), 25, 300, 1,
     {"seconds_per_step": 2.0, "training_seconds": 60.0, "steps_lost": 5, "estimated_remaining_seconds": 150,
      "goodput": 0.2, "reading_attempt": 1}),
    # no new step: nothing measured, nothing lost
    (_reading(30, 100, 1, seconds_per_step=2.0, training_seconds=60.0), 30, 150, 1,
     {"seconds_per_step": 2.0, "training_seconds": 60.0, "steps_lost": None, "percent": 30.0}),
])
def test_pace_eta_and_goodput(before, step, now, attempt, want):
    after = before.model_copy(update={"step": step, "last_step_time": iso(at(now)) if step != before.step
                                      else before.last_step_time})
    got = eta.update(before, after, attempt, at(now), created=at(0)).model_dump()
    assert {k: got[k] for k in want} == want


def test_a_restart_shows_in_goodput_and_the_eta_holds_its_pace():
    """Through the planner: a preemption costs goodput and steps, and the ETA after it still
    uses the pace measured before it."""
    body, pods = running_job(**{"training.totalTrainingSteps": 100})
    body["metadata"]["creationTimestamp"] = iso(at(0))
    for t, step in ((10, 0), (30, 10), (50, 20)):
        body = apply(body, reconcile.plan(body, pods, at(t), metrics={"step": step, "totalSteps": 100}))
    prog = body["status"]["progress"]
    assert (prog["secondsPerStep"], prog["percent"], prog["estimatedRemainingSeconds"]) == (2.0, 20.0, 160)
    body = apply(body, reconcile.plan(body, [terminated(pods[0], 143, "Preempted: checkpoint step-15"), pods[1]],
                                      at(55)))
    assert body["status"]["attempt"] == 1
    body = apply(body, reconcile.plan(body, [], at(70)))          # the new gang is created
    pods = pods_for(body, attempt=1)
    body = apply(body, reconcile.plan(body, pods, at(75)))        # ... and runs
    body = apply(body, reconcile.plan(body, pods, at(80), metrics={"step": 15, "totalSteps": 100}))
    prog = body["status"]["progress"]
    assert prog["stepsLost"] == 5 and prog["secondsPerStep"] == 2.0
    assert prog["estimatedRemainingSeconds"] == 170 and prog["goodput"] == 0.5   # 40 s of 80
    body = apply(body, reconcile.plan(body, pods, at(100), metrics={"step": 25, "totalSteps": 100}))
    assert body["status"]["progress"]["goodput"] == 0.6                         # 60 s of 100


def test_the_operator_exports_each_jobs_progress_and_forgets_a_deleted_job():
    from prometheus_client import REGISTRY

    from sftjob_operator import metrics

    def value(name):
        return REGISTRY.get_sample_value(name, {"namespace": "team-a", "name": "eta-job"})

    book = metrics.PhaseBook()
    book.set(("team-a", "eta-job"), "Running", Progress(percent=40.0, estimated_remaining_seconds=90, goodput=0.75))
    assert (value("sftjob_operator_job_progress_percent"), value("sftjob_operator_job_estimated_remaining_seconds"),
            value("sftjob_operator_job_goodput_ratio")) == (40.0, 90.0, 0.75)
    book.set(("team-a", "eta-job"), None)
    assert value("sftjob_operator_job_progress_percent") is None and value("sftjob_operator_job_goodput_ratio") is None
