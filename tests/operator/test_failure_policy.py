"""Failure policy, table-driven: each pod ending maps to one cause."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, UTC

import pytest
from .op_testkit import job_body, pods_for, terminated

from sftjob_operator import failure_policy as fp

pytestmark = pytest.mark.unit
POD = pods_for(job_body())[0]


def _with(**status):
    pod = copy.deepcopy(POD)
    pod["status"].update(status)
    return pod


def _deleted():
    pod = copy.deepcopy(POD)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pod


def _disrupted():
    return _with(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
                              "message": "preempted by a higher-priority pod"}])


@pytest.mark.parametrize("pod, state, reason", [
    (POD, fp.State.RUNNING, ""),
    (terminated(POD, 0), fp.State.SUCCEEDED, ""),
    (terminated(POD, 2, "InvalidData: column 'prompt' missing"), fp.State.FAILED, "InvalidData"),
    (terminated(POD, 1, "InvalidConfig: data.x: unknown key"), fp.State.FAILED, "InvalidConfig"),
    (terminated(POD, 1, "Traceback ...\nsomething broke"), fp.State.FAILED, "TrainingError"),
    (terminated(POD, 2), fp.State.FAILED, "InvalidConfig"),
    (terminated(POD, 1, "Preempted: checkpoint step-7 committed"), fp.State.PREEMPTED, "Preempted"),
    (terminated(POD, 143), fp.State.PREEMPTED, "Signalled"),
    (terminated(POD, 137), fp.State.PREEMPTED, "Signalled"),
    (terminated(POD, 130), fp.State.PREEMPTED, "Signalled"),
    (terminated(POD, 139), fp.State.FAILED, "Crashed"),       # SIGSEGV: the trainer's own crash
    (terminated(POD, 134), fp.State.FAILED, "Crashed"),       # SIGABRT (e.g. an NCCL abort)
    (terminated(POD, 137, reason="OOMKilled"), fp.State.FAILED, "OOMKilled"),
    (_with(phase="Failed", reason="Evicted", message="low memory"), fp.State.PREEMPTED, "Evicted"),
    (_with(phase="Failed", reason="NodeLost"), fp.State.PREEMPTED, "NodeLost"),
    (_disrupted(), fp.State.PREEMPTED, "PreemptionByScheduler"),
    (_deleted(), fp.State.PREEMPTED, "PodDeleted"),
    (_with(phase="Pending", containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]),
     fp.State.PENDING, "ImagePullBackOff"),
])
def test_classify_pod(pod, state, reason):
    out = fp.classify_pod(pod)
    assert (out.state, out.reason) == (state, reason)


def test_node_not_ready_is_preemption():
    assert fp.classify_pod(POD, node_ready=False).state is fp.State.PREEMPTED
    assert fp.classify_pod(POD, node_ready=None).state is fp.State.RUNNING


NOT_READY_AT_20 = fp.NodeReadiness(False, since=datetime(2026, 1, 1, 12, 0, 20, tzinfo=UTC))


def _bound_at(stamp):
    return _with(conditions=[{"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp}])


@pytest.mark.parametrize("pod, node, held", [
    (POD, None, None),                                                    # never read
    (POD, fp.NodeReadiness(True), True),
    (POD, fp.NodeReadiness(False), False),                                # since unknown
    (POD, NOT_READY_AT_20, False),                                        # binding unknown
    (_bound_at("2026-01-01T12:00:05Z"), NOT_READY_AT_20, False),          # bound, then lost
    (_bound_at("2026-01-01T12:00:20Z"), NOT_READY_AT_20, False),          # same second: held
    (_bound_at("2026-01-01T12:00:21Z"), NOT_READY_AT_20, None),           # bound to it since: outdated
    (_with(conditions=[{"type": "PodScheduled", "status": "False",
                        "lastTransitionTime": "2026-01-01T12:00:30Z"}]), NOT_READY_AT_20, False),
])
def test_a_not_ready_reading_is_held_only_against_pods_bound_before_it(pod, node, held):
    assert fp.node_ready_for(pod, node) is held


def test_termination_message_parsing():
    assert fp.parse_termination_message("InvalidData: no rows") == ("InvalidData", "no rows")
    assert fp.parse_termination_message("log line\nTrainingError: nan loss") == ("TrainingError", "nan loss")
    assert fp.parse_termination_message("plain text without reason")[0] == ""
    assert fp.parse_termination_message(None) == ("", "")


R, S, P, F = (fp.PodOutcome(fp.State.RUNNING), fp.PodOutcome(fp.State.SUCCEEDED),
              fp.PodOutcome(fp.State.PREEMPTED, "Evicted", "x"), fp.PodOutcome(fp.State.FAILED, "TrainingError", "y"))
BAD = fp.classify_pod(terminated(POD, 2, "InvalidData: column 'prompt' missing"))
SIG = fp.classify_pod(terminated(POD, 137))
SEGV = fp.classify_pod(terminated(POD, 139))


@pytest.mark.parametrize("outcomes, verdict, reason", [
    ({0: R, 1: R}, fp.Verdict.RUNNING, ""),
    ({0: S, 1: R}, fp.Verdict.RUNNING, ""),
    ({0: S, 1: S}, fp.Verdict.SUCCEEDED, ""),
    ({0: R}, fp.Verdict.RESTART_PREEMPTED, "PodDeleted"),
    ({0: R, 1: P}, fp.Verdict.RESTART_PREEMPTED, "Evicted"),
    ({0: R, 1: F}, fp.Verdict.RESTART_FAILED, "TrainingError"),
    # A peer's generic failure after an eviction is the eviction's doing: one preemption.
    ({0: P, 1: F}, fp.Verdict.RESTART_PREEMPTED, "Evicted"),
    ({0: F}, fp.Verdict.RESTART_PREEMPTED, "PodDeleted"),
    # A rank SIGKILLed (by an admin, a chaos test, the node's OOM killer) takes its peer down
    # the same way; a rank crashing on a signal of its own is a failure; and a
    # deterministic failure wins over everything.
    ({0: SIG, 1: F}, fp.Verdict.RESTART_PREEMPTED, "Signalled"),
    ({0: SEGV, 1: F}, fp.Verdict.RESTART_FAILED, "Crashed"),
    ({0: P, 1: BAD}, fp.Verdict.FAILED, "InvalidData"),
    ({0: BAD, 1: R}, fp.Verdict.FAILED, "InvalidData"),
    ({0: R, 1: fp.PodOutcome(fp.State.PENDING, "ImagePullBackOff")}, fp.Verdict.STARTING, ""),
])
def test_judge_gang(outcomes, verdict, reason):
    got = fp.judge_gang(outcomes, nodes=2)
    assert (got.verdict, got.reason) == (verdict, reason)


def test_restart_delay_doubles_and_caps():
    assert [fp.restart_delay(10, n) for n in range(6)] == [10, 20, 40, 80, 160, 300]
    assert fp.restart_delay(0, 5) == 0


@pytest.mark.parametrize("pod, permanent", [
    (terminated(POD, 2, "InvalidData: column 'prompt' missing"), True),
    (terminated(POD, 2), True),                      # exit 2 without a message is still permanent
    (terminated(POD, 1, "InvalidConfig: data.x: unknown key"), True),
    (terminated(POD, 1, "TrainingError: nan loss"), False),
    (terminated(POD, 137, reason="OOMKilled"), False),
])
def test_deterministic_failures_are_permanent(pod, permanent):
    assert fp.classify_pod(pod).permanent is permanent


def test_waiting_pods_say_why():
    secret = _with(phase="Pending", containerStatuses=[{"state": {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "sftjob-s3" not found'}}}])
    unsched = _with(phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                  "message": "0/2 nodes are available: 2 Insufficient cpu."}])
    verdict = fp.judge_gang({0: fp.classify_pod(unsched), 1: fp.classify_pod(secret)}, nodes=2)
    assert verdict.verdict is fp.Verdict.STARTING
    assert (verdict.stuck_reason, verdict.stuck_message) == (
        "CreateContainerConfigError", 'rank 1: secret "sftjob-s3" not found')
    verdict = fp.judge_gang({0: fp.classify_pod(unsched), 1: R}, nodes=2)
    assert (verdict.stuck_reason, verdict.stuck_message) == (
        "Unschedulable", "rank 0: 0/2 nodes are available: 2 Insufficient cpu.")


# -- a generic failure beside a peer that still "runs": the peer node's Lease decides -------------
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def _on(pod, node):
    pod = copy.deepcopy(pod)
    pod["spec"]["nodeName"] = node
    return pod


def _failed_at(exit_code, at, message="TrainingError: RuntimeError: Connection closed by peer"):
    pod = _on(terminated(POD, exit_code, message), "node-b")
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = at.isoformat().replace("+00:00", "Z")
    return pod


def _lease(renewed_s):
    return fp.NodeLease(renewed=T0 + timedelta(seconds=renewed_s), duration_s=40)


@pytest.mark.parametrize("failed_exit, lease_renewed_s, now_s, peer, hold, verdict", [
    # node-a renewed 3 s after rank 1 failed: alive; the verdict still waits ECHO_SETTLE_S for
    # rank 0's own status (a SIGKILL shows late), then the failure is a failure
    (1, 3, 5, fp.State.RUNNING, 5.0, fp.Verdict.RESTART_FAILED),
    (1, 3, 12, fp.State.RUNNING, 0.0, fp.Verdict.RESTART_FAILED),
    # node-a last renewed 2 s before the failure and it is 5 s later: wait for its next renewal
    (1, -2, 5, fp.State.RUNNING, 33.0, fp.Verdict.RESTART_FAILED),
    # a renewal within the second of finishedAt may predate the failure: still wait
    (1, 0.5, 5, fp.State.RUNNING, 35.5, fp.Verdict.RESTART_FAILED),
    # silent for the Lease's whole duration: node-a is gone, the failure was its echo
    (1, -2, 38, fp.State.PREEMPTED, 0.0, fp.Verdict.RESTART_PREEMPTED),
    # a deterministic failure or a crash is not an echo: nothing waits
    (2, -2, 5, fp.State.RUNNING, 0.0, fp.Verdict.FAILED),
    (139, -2, 5, fp.State.RUNNING, 0.0, fp.Verdict.RESTART_FAILED),
])
def test_a_generic_failure_waits_for_the_running_peers_node(failed_exit, lease_renewed_s, now_s, peer, hold, verdict):
    pods = {0: _on(POD, "node-a"), 1: _failed_at(failed_exit, T0)}
    outcomes = {r: fp.classify_pod(p) for r, p in pods.items()}
    settled, wait = fp.settle_generic_failure(outcomes, pods, {"node-a": _lease(lease_renewed_s)},
                                              T0 + timedelta(seconds=now_s))
    assert settled[0].state is peer
    assert wait == pytest.approx(hold)
    got = fp.judge_gang(settled, 2)
    assert got.verdict is verdict
    if peer is fp.State.PREEMPTED:
        assert got.reason == "NodeLeaseExpired" and "node node-a has not renewed its Lease" in got.message
        assert "rank 1 then failed (TrainingError), counted with the preemption" in got.message


def test_without_a_lease_only_the_echo_window_waits_and_without_a_finish_time_nothing():
    pods = {0: _on(POD, "node-a"), 1: _failed_at(1, T0)}
    outcomes = {r: fp.classify_pod(p) for r, p in pods.items()}
    assert fp.settle_generic_failure(outcomes, pods, {}, T0 + timedelta(seconds=5)) == (outcomes, 5.0)
    assert fp.settle_generic_failure(outcomes, pods, {}, T0 + timedelta(seconds=11)) == (outcomes, 0.0)
    del pods[1]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"]
    assert fp.settle_generic_failure(outcomes, pods, {"node-a": _lease(-2)}, T0) == (outcomes, 0.0)
