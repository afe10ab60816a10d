"""Success policy: what the status says once every rank exited 0."""
from __future__ import annotations

import pytest

from sftjob_operator import success
from sftjob_operator.status import Progress

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("before, after", [
    # the last scrape predates the final steps: the run is shown complete
    (Progress(step=37, total_steps=40, summary="37/40", loss=1.5), Progress(step=40, total_steps=40,
                                                                        summary="40/40", loss=1.5)),
    (Progress(step=40, total_steps=40, summary="40/40"), Progress(step=40, total_steps=40, summary="40/40")),
    # never scraped (a run shorter than one scrape): nothing to claim
    (Progress(), Progress()),
    (Progress(step=3), Progress(step=3)),
])
def test_final_progress(before, after):
    assert success.final_progress(before) == after


def test_early_stop_succeeds_with_its_reason_and_keeps_the_step():
    from .op_testkit import apply, at, cond, running_job, terminated

    body, pods = running_job()
    body["status"]["progress"] = {"step": 8, "totalSteps": 20, "summary": "8/20"}
    why = "stopped early at step 8 of 20: 3 validations in a row without a lower validation loss"
    done = [terminated(pods[0], 0, f"EarlyStopped: {why}; model exported to s3://runs/x/hf/final"),
            terminated(pods[1], 0)]
    from sftjob_operator import reconcile

    st = apply(body, reconcile.plan(body, done, at(60)))["status"]
    assert st["phase"] == "Succeeded" and cond(st, "Ready")["reason"] == "EarlyStopped"
    assert why in st["message"] and st["progress"]["step"] == 8
    # an ordinary success still claims the last step
    plain = [terminated(pods[0], 0, "Succeeded: model exported to s3://runs/x/hf/final"), terminated(pods[1], 0)]
    st = apply(body, reconcile.plan(body, plain, at(60)))["status"]
    assert cond(st, "Ready")["reason"] == "TrainingSucceeded" and st["progress"]["step"] == 20
