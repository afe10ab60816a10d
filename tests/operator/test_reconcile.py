"""The reconcile decision, driven through whole lifecycles without a cluster."""
from __future__ import annotations

import pytest
from .op_testkit import apply, at, cond, job_body, pods_for, running_job, terminated

from sftjob_operator import reconcile

pytestmark = pytest.mark.unit
def test_new_job_launches_gang_once():
    body = job_body()
    plan = reconcile.plan(body, [], at(0))
    assert plan.status["phase"] == "Pending"
    assert [p["metadata"]["name"] for p in plan.launch] == ["tiny-node-0", "tiny-node-1"]
    launched = dict(plan.launched_status)
    assert set(launched.pop("launchedSpec")) == {"resources", "checkpoint", "output",
                                                 "runPolicy.terminationGracePeriodSeconds"}
    assert launched == {"launchedAttempt": 0, "launchTime": "2026-01-01T12:00:00Z", "launchedGeneration": 1}
    assert cond(plan.status, "Ready")["status"] == "False"
    assert cond(plan.status, "Reconciling")["status"] == "True"
    # Pods pending: nothing more to do.
    body = apply(body, plan)
    again = reconcile.plan(body, pods_for(body, phase="Pending"), at(1))
    assert not again.launch and not again.delete_pods


def test_crash_mid_launch_creates_only_missing_ranks():
    body = job_body()
    body = apply(body, reconcile.plan(body, [], at(0)))
    body["status"].pop("launchedAttempt")  # the operator died before recording the launch
    plan = reconcile.plan(body, pods_for(body)[:1], at(1))
    assert [p["metadata"]["name"] for p in plan.launch] == ["tiny-node-1"]


def test_running_mirrors_progress_and_is_quiet_when_nothing_changes():
    body, pods = running_job()
    assert body["status"]["startTime"] == "2026-01-01T12:00:05Z"
    assert cond(body["status"], "Ready")["status"] == "True"
    m = {"step": 7, "totalSteps": 20, "loss": 1.23456, "tokensPerSecond": 999.44, "lastCheckpointStep": 5}
    plan = reconcile.plan(body, pods, at(10), metrics=m)
    prog = plan.status["progress"]
    assert (prog["summary"], prog["loss"], prog["tokensPerSecond"]) == ("7/20", 1.2346, 999.4)
    body = apply(body, plan)
    assert reconcile.plan(body, pods, at(20), metrics=m).status is None
    assert reconcile.plan(body, pods, at(20)).requeue_after == reconcile.PROGRESS_INTERVAL_S


def test_deleted_pod_restarts_whole_gang_as_preemption():
    body, pods = running_job()
    plan = reconcile.plan(body, pods[:1], at(30))  # rank 1 vanished
    st = plan.status
    assert st["phase"] == "Restarting"
    assert st["restarts"] == {"failures": 0, "preemptions": 1, "total": 1}
    assert st["attempt"] == 1 and st["restartAfter"] == "2026-01-01T12:00:40Z"
    assert plan.delete_pods == ["tiny-node-0"] and plan.restart_cause == "preemption"
    assert plan.events[0].reason == "RestartingAfterPreemption"
    body = apply(body, plan)
    # Old rank 0 still terminating: wait, never launch next to it.
    old = pods[:1]
    old[0]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:30Z"
    plan = reconcile.plan(body, old, at(45))
    assert not plan.launch and not plan.delete_pods and not plan.force_delete_pods
    assert cond(plan.status, "Ready")["reason"] == "WaitingForPodsToTerminate"  # says why it waits
    assert "tiny-node-0" in plan.status["message"]
    assert reconcile.plan(apply(body, plan), old, at(47)).status is None  # ... once
    # Gone, but back-off not over: wait.
    assert not reconcile.plan(body, [], at(35)).launch
    # After the back-off: the new gang, attempt 1.
    plan = reconcile.plan(body, [], at(41))
    assert [p["metadata"]["labels"]["sftjob.io/attempt"] for p in plan.launch] == ["1", "1"]
    body = apply(body, plan)
    plan = reconcile.plan(body, pods_for(body, attempt=1), at(50))
    assert plan.status["phase"] == "Running"
    assert plan.status["restarts"]["preemptions"] == 1


def test_success_when_every_rank_exits_zero():
    body, pods = running_job(**{"runPolicy.ttlSecondsAfterFinished": 60})
    plan = reconcile.plan(body, [terminated(pods[0], 0), pods[1]], at(30))
    assert plan.status is None or plan.status["phase"] == "Running"
    plan = reconcile.plan(body, [terminated(p, 0) for p in pods], at(31))
    assert plan.status["phase"] == "Succeeded"
    assert plan.status["output"]["uri"].endswith("/team-a/tiny/" + body["metadata"]["uid"] + "/hf/final")
    assert plan.status["completionTime"] == "2026-01-01T12:00:31Z"
    assert cond(plan.status, "Ready")["status"] == "True"
    assert plan.requeue_after == pytest.approx(60)
    body = apply(body, plan)
    assert not reconcile.plan(body, [], at(60)).delete_job
    assert reconcile.plan(body, [], at(91)).delete_job


def test_failure_spends_backoff_then_fails_with_trainer_reason():
    body, pods = running_job()  # backoffLimit 1
    bad = [terminated(pods[0], 1, "TrainingError: loss is nan"), pods[1]]
    plan = reconcile.plan(body, bad, at(30))
    assert plan.status["phase"] == "Restarting" and plan.restart_cause == "failure"
    assert plan.status["restarts"] == {"failures": 1, "preemptions": 0, "total": 1}
    body = apply(body, plan)
    body = apply(body, reconcile.plan(body, [], at(41)))
    pods = pods_for(body, attempt=1)
    body = apply(body, reconcile.plan(body, pods, at(45)))
    still_running = pods[1]
    plan = reconcile.plan(body, [terminated(pods[0], 1, "TrainingError: loss is nan"), still_running], at(50))
    st = plan.status
    assert st["phase"] == "Failed"
    failed = cond(st, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "TrainingError"
    assert "BackoffLimitExceeded" in failed["message"] and "loss is nan" in failed["message"]
    assert cond(st, "Stalled")["status"] == "True"
    assert plan.delete_pods == ["tiny-node-1"]  # nothing left running


def test_preemption_limit():
    body, pods = running_job(**{"runPolicy.preemptionLimit": 0})
    plan = reconcile.plan(body, [pods[0]], at(30))
    assert plan.status["phase"] == "Failed"
    assert cond(plan.status, "Failed")["reason"] == "PreemptionLimitExceeded"


def test_suspend_and_resume():
    body, pods = running_job()
    body["spec"]["suspend"] = True
    plan = reconcile.plan(body, pods, at(30))
    assert plan.status["phase"] == "Suspended" and plan.status["attempt"] == 1
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]
    assert "startTime" not in plan.status
    body = apply(body, plan)
    assert reconcile.plan(body, [], at(40)).status is None  # stays suspended, quietly
    body["spec"]["suspend"] = False
    plan = reconcile.plan(body, [], at(50))
    assert plan.status["phase"] == "Pending" and len(plan.launch) == 2
    assert plan.status["restarts"]["total"] == 0  # a suspension is not a restart


def test_startup_deadline():
    body = job_body({"runPolicy.startupDeadlineSeconds": 60})
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body, phase="Pending")
    pods[1]["status"]["containerStatuses"] = [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]
    assert not reconcile.plan(body, pods, at(30)).delete_pods
    plan = reconcile.plan(body, pods, at(61))
    assert plan.status["phase"] == "Failed"
    failed = cond(plan.status, "Failed")
    assert failed["reason"] == "StartupDeadlineExceeded" and "ImagePullBackOff" in failed["message"]
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]


def test_active_deadline():
    body, pods = running_job(**{"runPolicy.activeDeadlineSeconds": 100})
    assert reconcile.plan(body, pods, at(50)).requeue_after <= 55
    plan = reconcile.plan(body, pods, at(106))
    assert cond(plan.status, "Failed")["reason"] == "DeadlineExceeded"


def test_clean_pod_policy_all_deletes_finished_pods():
    body, pods = running_job(**{"runPolicy.cleanPodPolicy": "All"})
    plan = reconcile.plan(body, [terminated(p, 0) for p in pods], at(31))
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]


def test_invalid_spec_fails_once():
    body = job_body({"data.trainBatchSize": 3})
    plan = reconcile.plan(body, [], at(0))
    assert plan.invalid and plan.status["phase"] == "Failed"
    assert cond(plan.status, "Failed")["reason"] == "InvalidSpec"
    assert plan.status["observedGeneration"] == 1   # kstatus: observed, and Failed (not still in progress)
    body = apply(body, plan)
    again = reconcile.plan(body, [], at(5))
    assert again.invalid and again.status is None and not again.events


def test_conditions_keep_transition_time():
    body, pods = running_job()
    ready_since = cond(body["status"], "Ready")["lastTransitionTime"]
    plan = reconcile.plan(body, pods, at(500), metrics={"step": 1, "totalSteps": 20})
    assert cond(plan.status, "Ready")["lastTransitionTime"] == ready_since


def test_pods_of_another_job_with_same_name_are_ignored():
    body, pods = running_job()
    for p in pods:
        p["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    plan = reconcile.plan(body, pods, at(30))
    assert plan.status["phase"] == "Restarting"  # our pods are gone; theirs are not ours to judge
    assert plan.delete_pods == []
