"""A planned stop (suspend, resize) asks for a checkpoint and waits for it (stop_request.py)."""
from __future__ import annotations

import copy

import pytest

from sftjob_operator import reconcile, stop_request

from .op_testkit import apply, at, job_body, pods_for
from .test_elastic import TWO, gang, launch

pytestmark = pytest.mark.unit

TRAINING = {"step": 7, "totalSteps": 100, "lastCheckpointStep": 5}


def running_job() -> tuple[dict, list[dict]]:
    body = job_body()
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body)
    return apply(body, reconcile.plan(body, pods, at(5), metrics=TRAINING)), pods


def suspended(body: dict) -> dict:
    body = copy.deepcopy(body)
    body["spec"]["suspend"] = True
    return body


def test_a_suspend_asks_for_a_checkpoint_and_stops_once_it_committed():
    body, pods = running_job()
    body = suspended(body)
    plan = reconcile.plan(body, pods, at(10), metrics=TRAINING)
    assert plan.checkpoint_hold_s == stop_request.HOLD_S and not plan.delete_pods
    assert plan.status["phase"] == "Running" and plan.status["checkpointRequest"]["step"] == 7
    assert [e.reason for e in plan.events] == [stop_request.REASON_REQUESTED] and plan.requeue_after <= 1
    body = apply(body, plan)
    # Not yet committed: it waits, and asks nothing again.
    plan = reconcile.plan(body, pods, at(12), metrics={**TRAINING, "lastCheckpointStep": 5})
    assert not plan.delete_pods and plan.checkpoint_hold_s is None and plan.new_status is None
    # Committed at the step it was asked at: now the pods go.
    plan = reconcile.plan(body, pods, at(14), metrics={**TRAINING, "lastCheckpointStep": 7})
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]
    assert plan.status["phase"] == "Suspended" and "checkpointRequest" not in plan.status
    assert stop_request.REASON_DONE in [e.reason for e in plan.events]


@pytest.mark.parametrize("reading", [
    None,                                                          # rank 0 not read (yet): nothing known to lose
    {"step": 0, "totalSteps": 0},                                  # the trainer is still loading
    {"step": 7, "totalSteps": 100, "lastCheckpointStep": 7},       # the newest checkpoint is this step
])
def test_nothing_to_lose_stops_at_once(reading):
    body, pods = running_job()
    plan = reconcile.plan(suspended(body), pods, at(10), metrics=reading)
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"] and plan.checkpoint_hold_s is None


@pytest.mark.parametrize("failed, t", [(None, 10 + stop_request.WAIT_S), ("connection refused", 11)])
def test_an_unanswered_request_stops_anyway(failed, t):
    body, pods = running_job()
    body = apply(suspended(body), reconcile.plan(suspended(body), pods, at(10), metrics=TRAINING))
    if failed:
        body["status"]["checkpointRequest"]["failed"] = failed
    plan = reconcile.plan(body, pods, at(t - 1), metrics=TRAINING) if not failed else None
    assert plan is None or not plan.delete_pods
    plan = reconcile.plan(body, pods, at(t), metrics=TRAINING)
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"] and plan.status["phase"] == "Suspended"
    warning = [e for e in plan.events if e.reason == stop_request.REASON_NOT_DONE]
    assert warning and (failed or f"{stop_request.WAIT_S:.0f}s") in warning[0].message


def test_a_request_of_an_earlier_attempt_is_not_awaited():
    body, pods = running_job()
    body = apply(suspended(body), reconcile.plan(suspended(body), pods, at(10), metrics=TRAINING))
    body["status"]["checkpointRequest"]["attempt"] = body["status"]["attempt"] - 1
    plan = reconcile.plan(body, pods, at(11), metrics=TRAINING)
    assert plan.checkpoint_hold_s == stop_request.HOLD_S and not plan.delete_pods   # asks its own gang again


def test_a_resize_of_a_running_gang_checkpoints_first():
    body = job_body({"resources.minNodes": 1})
    body, _ = launch(body, 0, TWO)
    running = gang(body, 2, 0)
    body = apply(body, reconcile.plan(body, running, at(5), cluster_nodes=TWO, metrics=TRAINING))
    body["spec"]["resources"]["nodes"] = 1
    body["metadata"]["generation"] = 2
    plan = reconcile.plan(body, running, at(20), cluster_nodes=TWO, metrics=TRAINING)
    assert plan.checkpoint_hold_s is not None and not plan.delete_pods and plan.status["nodes"] == 2
    assert "resize to 1" in plan.status["checkpointRequest"]["reason"]
    body = apply(body, plan)
    plan = reconcile.plan(body, running, at(23), cluster_nodes=TWO, metrics={**TRAINING, "lastCheckpointStep": 8})
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"] and plan.status["nodes"] == 1
    assert plan.status["resizes"]["lastReason"] == "SpecChanged"
