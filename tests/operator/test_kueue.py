"""Kueue's pod-group integration, decided without a cluster: labels per gang attempt, a gated
gang is queued (no startup deadline), Kueue's eviction is a preemption, suspend says the
quota is released. The real Kueue is in test_kueue_cluster.py."""
from __future__ import annotations

import copy

import pytest

from sftjob_operator import failure_policy as fp
from sftjob_operator import queueing, reconcile

from .op_testkit import UID, apply, at, job_body, observe, pods_for, terminated

pytestmark = pytest.mark.unit
def queued_body(**spec):
    body = job_body(spec)
    body["metadata"]["labels"] = {queueing.QUEUE_LABEL: "team-a"}
    return body


def as_kueue_sees(pods, gated: bool):
    """The pods after Kueue's webhook (managed label, finalizer, gate) and, unless gated, its
    admission (gates removed, then scheduled)."""
    out = []
    for p in copy.deepcopy(pods):
        p["metadata"]["labels"][queueing.MANAGED_LABEL] = "true"
        p["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]
        if gated:
            p["spec"]["schedulingGates"] = [{"name": queueing.ADMISSION_GATE}, {"name": "kueue.x-k8s.io/topology"}]
            p["spec"].pop("nodeName", None)
            p["status"] = {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]}
        out.append(p)
    return out


def launched(body, attempt=0):
    plan = reconcile.plan(body, [], at(0))
    return apply(body, plan), plan


def observed(plan, phase="Running"):
    """The pods the plan launched, as pods_for() observes them (same node names, status)."""
    return observe(plan.launch, phase)


def cond(status, ctype):
    return next((c for c in status["conditions"] if c["type"] == ctype), None)


def test_group_name_changes_per_attempt_and_is_a_label_value():
    assert queueing.group_name("tiny", UID, 0) == "tiny-0f5c1a52-a0"
    assert queueing.group_name("tiny", UID, 3) == "tiny-0f5c1a52-a3"
    long = queueing.group_name("x" * 80, UID, 12)
    assert len(long) <= 63 and long.endswith("-0f5c1a52-a12")


def test_without_the_queue_label_nothing_changes():
    body = job_body()
    body["metadata"]["labels"] = {"team": "a"}
    _, plan = launched(body)
    for pod in plan.launch:
        assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["labels"])
        assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["annotations"])
    assert cond(plan.status, queueing.ADMITTED) is None


def test_every_pod_of_an_attempt_is_one_pod_group():
    body = queued_body()
    body["metadata"]["labels"][queueing.PRIORITY_CLASS_LABEL] = "high"
    _, plan = launched(body)
    assert len(plan.launch) == 2
    for pod in plan.launch:
        labels, ann = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels[queueing.QUEUE_LABEL] == "team-a"
        assert labels[queueing.GROUP_LABEL] == "tiny-0f5c1a52-a0"
        assert labels[queueing.PRIORITY_CLASS_LABEL] == "high"
        assert ann[queueing.TOTAL_COUNT_ANNOTATION] == "2"
        assert ann[queueing.RETRIABLE_ANNOTATION] == "false"
    admitted = cond(plan.status, queueing.ADMITTED)
    assert admitted["status"] == "False" and admitted["reason"] == queueing.REASON_WAITING


def test_gated_gang_is_queued_past_the_startup_deadline_then_counts_from_admission():
    body, first = launched(queued_body(**{"runPolicy.startupDeadlineSeconds": 60}))
    gated = as_kueue_sees(observed(first, "Pending"), gated=True)
    assert fp.classify_pod(gated[0]).reason == queueing.REASON_QUEUED
    # Queued for an hour: never failed, says it is queued, and where.
    for t in (5, 600, 3600):
        plan = reconcile.plan(body, gated, at(t))
        body = apply(body, plan)
        st = body["status"]
        assert st["phase"] == "Pending", st
        assert cond(st, "Ready")["reason"] == queueing.REASON_QUEUED
        assert "LocalQueue team-a" in st["message"] and "tiny-0f5c1a52-a0" in st["message"]
        assert cond(st, queueing.ADMITTED)["status"] == "False"
    assert [e.reason for e in plan.events] == []  # the Event was posted once, at the first pass
    # Admitted at 3600 s: pods ungated but not yet running; the deadline counts from then.
    admitted = as_kueue_sees(observed(first, "Pending"), gated=False)
    body = apply(body, reconcile.plan(body, admitted, at(3601)))
    adm = cond(body["status"], queueing.ADMITTED)
    assert adm["status"] == "True" and adm["lastTransitionTime"] == "2026-01-01T13:00:01Z"
    assert body["status"]["phase"] == "Pending"
    body = apply(body, reconcile.plan(body, admitted, at(3650)))
    assert body["status"]["phase"] == "Pending"
    plan = reconcile.plan(body, admitted, at(3662))
    assert plan.status["phase"] == "Failed"
    assert "after admission by Kueue" in plan.status["message"]


def test_kueue_eviction_is_a_preemption_and_the_next_attempt_is_a_new_group():
    body, first = launched(queued_body())
    running = as_kueue_sees(observed(first), gated=False)
    body = apply(body, reconcile.plan(body, running, at(5)))
    assert body["status"]["phase"] == "Running"
    # Kueue preempts the Workload: TerminationTarget on every pod, then deletes them; the
    # trainer checkpoints on SIGTERM and exits (143 here), a peer with a generic error.
    evicted = []
    for i, p in enumerate(running):
        q = terminated(p, 143 if i == 0 else 1, "Preempted: stopped at step 12" if i == 0 else "")
        q["metadata"]["deletionTimestamp"] = "2026-01-01T12:01:00Z"
        q["status"].setdefault("conditions", []).append(
            {"type": queueing.TERMINATION_TARGET, "status": "True", "reason": "WorkloadEvictedDueToPreempted",
             "message": "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"})
        evicted.append(q)
    out = fp.classify_pod(evicted[1])
    assert out.state is fp.State.PREEMPTED and out.reason == "WorkloadEvictedDueToPreempted"
    plan = reconcile.plan(body, evicted, at(60))
    assert plan.status["phase"] == "Restarting"
    assert plan.status["restarts"] == {"failures": 0, "preemptions": 1, "total": 1}
    assert "WorkloadEvictedDueToPreempted" in plan.status["message"]
    body = apply(body, plan)
    # Old pods gone (Kueue removed its finalizers): the next gang is a new pod group.
    plan = reconcile.plan(body, [], at(120))
    assert {p["metadata"]["labels"][queueing.GROUP_LABEL] for p in plan.launch} == {"tiny-0f5c1a52-a1"}
    assert cond(plan.status, queueing.ADMITTED)["status"] == "False"


def test_suspend_of_a_queued_job_says_the_quota_is_released():
    body, first = launched(queued_body())
    running = as_kueue_sees(observed(first), gated=False)
    body = apply(body, reconcile.plan(body, running, at(5)))
    body["spec"]["suspend"] = True
    plan = reconcile.plan(body, running, at(10))
    assert plan.status["phase"] == "Suspended"
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]
    adm = cond(plan.status, queueing.ADMITTED)
    assert adm["status"] == "False" and "releases its quota" in adm["message"]


def test_pods_never_gated_say_kueue_does_not_manage_them():
    body, first = launched(queued_body())
    pods = observed(first)  # no managed label: no webhook in this namespace
    plan = reconcile.plan(body, pods, at(5))
    adm = cond(plan.status, queueing.ADMITTED)
    assert adm["reason"] == queueing.REASON_NOT_MANAGED and plan.status["phase"] == "Running"


def _group(gated: bool | None):
    """The launched gang of a queued job: gated by Kueue (True), admitted (False), or never
    taken in by Kueue's webhook (None)."""
    _, plan = launched(queued_body())
    pods = observed(plan)
    return pods if gated is None else as_kueue_sees(pods, gated)


@pytest.mark.parametrize("pods, admitted, reason, queued", [
    (pods_for(job_body()), None, None, None),                    # no pod group: not Kueue's
    (_group(gated=True), False, queueing.REASON_WAITING, True),
    (_group(gated=False), True, queueing.REASON_ADMITTED, False),
    (_group(gated=None), True, queueing.REASON_NOT_MANAGED, False),  # runs outside any quota
])
def test_admission(pods, admitted, reason, queued):
    got = queueing.admission(pods)
    if admitted is None:
        assert got is None
    else:
        assert (got.admitted, got.reason, got.queued) == (admitted, reason, queued)
