"""The elastic resize policy (elastic.py, sizes.py), table-tested, and its passes through
the planner: shrink on lost capacity, shrink when a gang cannot start, grow back after the
cooldown, an edit of resources.nodes, and no resize counted as a failure or preemption."""
from __future__ import annotations

import copy

import pytest

from sftjob_operator import builders, elastic, reconcile, sizes

from .op_testkit import apply, at, job_body, observe


def node(name: str, ready: bool = True, cordoned: bool = False, taints=None, labels=None,
         cpu: str = "8", memory: str = "32Gi", gpus: int = 0) -> dict:
    labels = {"pool": "train"} if labels is None else labels
    alloc = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": cordoned, "taints": taints or []},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "allocatable": alloc}}


def spec_of(**over) -> object:
    return builders.parse_spec(job_body({"resources.minNodes": 1, **over})["spec"])


# -- sizes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, allowed", [
    ({}, [2, 1]),
    ({"resources.minNodes": None}, [2]),                                  # not elastic
    ({"resources.nodes": 4, "data.trainBatchSize": 8}, [4, 2, 1]),        # 3 does not divide 8
    ({"resources.nodes": 4, "data.trainBatchSize": 12}, [4, 3, 2, 1]),
    ({"resources.nodes": 4, "resources.minNodes": 2, "data.trainBatchSize": 8}, [4, 2]),
    ({"resources.nodes": 4, "data.trainBatchSize": 8, "training.sequenceParallelSize": 2}, [4, 2]),
])
def test_allowed_sizes_skip_those_the_batch_does_not_divide(over, allowed):
    assert sizes.allowed(spec_of(**over)) == allowed


def test_misfit_names_the_fields():
    spec = spec_of(**{"resources.nodes": 4, "data.trainBatchSize": 8})
    assert "spec.data.trainBatchSize (8)" in sizes.misfit(spec, 3)
    sp = spec_of(**{"resources.nodes": 3, "data.trainBatchSize": 6, "training.sequenceParallelSize": 2})
    assert "spec.training.sequenceParallelSize (2)" in sizes.misfit(sp, 3)


# -- which nodes can host a pod ----------------------------------------------------------------
@pytest.mark.parametrize("n, fits", [
    (node("a"), True),
    (node("a", ready=False), False),
    (node("a", cordoned=True), False),
    (node("a", taints=[{"key": "spot", "effect": "NoSchedule"}]), False),
    (node("a", taints=[{"key": "spot", "effect": "PreferNoSchedule"}]), True),
    (node("a", taints=[{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]), True),   # tolerated below
    (node("a", cpu="2"), False),
    (node("a", memory="8Gi"), False),
    (node("a", labels={"pool": "other"}), False),
])
def test_eligible_nodes(n, fits):
    spec = spec_of(**{"resources.cpu": 4, "resources.memory": "16Gi", "resources.nodeSelector": {"pool": "train"},
                      "resources.tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes",
                                                 "effect": "NoSchedule"}]})
    assert elastic.eligible_nodes([n], spec) == int(fits)


def test_gpu_allocatable_is_counted():
    spec = spec_of(**{"resources.gpusPerNode": 8})
    assert elastic.eligible_nodes([node("a", gpus=8), node("b", gpus=4), node("c")], spec) == 1


@pytest.mark.parametrize("over, eligible, size", [
    ({}, 2, 2), ({}, 1, 1), ({}, 0, 1), ({}, None, 2),
    ({"resources.minNodes": None}, 1, 2),        # a fixed-size job waits at its size
    ({"resources.nodes": 4, "data.trainBatchSize": 8}, 3, 2),
])
def test_launch_size(over, eligible, size):
    assert elastic.launch_size(spec_of(**over), eligible) == size


# -- through the planner ------------------------------------------------------------------------
def gang(body: dict, size: int, attempt: int, phase: str = "Running") -> list[dict]:
    spec = builders.parse_spec(body["spec"])
    pods = builders.build_pods(builders.JobRef.from_body(body), elastic.gang_spec(spec, size), attempt)
    return observe(pods, phase)


def launch(body: dict, t: float, nodes: list[dict]) -> tuple[dict, object]:
    plan = reconcile.plan(body, [], at(t), cluster_nodes=nodes)
    return apply(body, plan), plan


TWO, ONE = [node("node-0"), node("node-1")], [node("node-0"), node("node-1", cordoned=True)]


def test_node_lost_restarts_smaller_then_grows_back_after_the_cooldown():
    body = job_body({"resources.minNodes": 1, "resources.resizeCooldownSeconds": 60})
    body, plan = launch(body, 0, TWO)
    assert len(plan.launch) == 2 and body["status"]["nodes"] == 2
    assert all(e["name"] != "WORLD_SIZE" or e["value"] == "2" for e in plan.launch[0]["spec"]["containers"][0]["env"])
    body = apply(body, reconcile.plan(body, gang(body, 2, 0), at(5), cluster_nodes=TWO))
    # Node 1 is lost (its pod vanished) and cordoned: a preemption, then a gang of 1.
    plan = reconcile.plan(body, gang(body, 2, 0)[:1], at(30), cluster_nodes=ONE)
    assert plan.status["restarts"]["preemptions"] == 1
    body = apply(body, plan)
    body, plan = launch(body, 41, ONE)
    assert [p["metadata"]["labels"]["sftjob.io/rank"] for p in plan.launch] == ["0"]
    env = {e["name"]: e.get("value") for e in plan.launch[0]["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "1"
    st = body["status"]
    assert st["nodes"] == 1 and st["resizes"]["count"] == 1 and st["resizes"]["lastReason"] == "CapacityLost"
    assert any(e.reason == "CapacityLost" for e in plan.events)
    running = gang(body, 1, 1)
    body = apply(body, reconcile.plan(body, running, at(45), cluster_nodes=ONE))
    assert body["status"]["phase"] == "Running"
    # The node is back, but the cooldown (60 s from the launch at 41) holds the grow.
    plan = reconcile.plan(body, running, at(60), cluster_nodes=TWO)
    assert not plan.delete_pods and plan.requeue_after <= 41
    # After it: stop the gang of 1 (it checkpoints on SIGTERM) and start a gang of 2.
    plan = reconcile.plan(body, running, at(102), cluster_nodes=TWO)
    assert plan.delete_pods == ["tiny-node-0"]
    st = plan.status
    assert st["nodes"] == 2 and st["attempt"] == 2 and st["resizes"]["count"] == 2
    assert st["resizes"]["lastReason"] == "CapacityReturned" and "restartAfter" not in st
    assert st["restarts"] == {"failures": 0, "preemptions": 1, "total": 1}   # a resize is neither
    body = apply(body, plan)
    body, plan = launch(body, 104, TWO)
    assert len(plan.launch) == 2 and body["status"]["nodes"] == 2


def test_a_fixed_size_job_never_shrinks():
    body = job_body()
    body, plan = launch(body, 0, ONE)
    assert len(plan.launch) == 2
    pending = gang(body, 2, 0)
    pending[1]["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes available"}]}
    plan = reconcile.plan(body, pending, at(120), cluster_nodes=None)
    assert not plan.delete_pods


def test_a_gang_that_cannot_start_steps_down_a_size():
    body = job_body({"resources.minNodes": 1})
    body, plan = launch(body, 0, TWO)        # both nodes look eligible ...
    pending = gang(body, 2, 0)
    pending[1]["status"] = {"phase": "Pending", "conditions": [   # ... but the scheduler disagrees
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "Insufficient cpu"}]}
    plan = reconcile.plan(body, pending, at(10), cluster_nodes=TWO)
    assert not plan.delete_pods                                        # within the grace
    plan = reconcile.plan(body, pending, at(elastic.SHRINK_AFTER_S + 1), cluster_nodes=TWO)
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]   # no half gang holds resources
    st = plan.status
    assert st["nodes"] == 1 and st["resizes"]["lastReason"] == "NotAllScheduled" and st["restarts"]["total"] == 0
    body = apply(body, plan)
    body, plan = launch(body, 35, TWO)   # the decided size holds, though both nodes look eligible
    assert len(plan.launch) == 1


def test_editing_nodes_resizes_a_running_job_at_a_checkpoint():
    body = job_body({"resources.minNodes": 1})
    body, _ = launch(body, 0, TWO)
    body = apply(body, reconcile.plan(body, gang(body, 2, 0), at(5), cluster_nodes=TWO))
    edited = copy.deepcopy(body)
    edited["spec"]["resources"]["nodes"] = 1
    edited["metadata"]["generation"] = 2
    plan = reconcile.plan(edited, gang(body, 2, 0), at(20), cluster_nodes=TWO)
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]
    assert plan.status["nodes"] == 1 and plan.status["resizes"]["lastReason"] == "SpecChanged"
    body, plan = launch(apply(edited, plan), 22, TWO)
    assert len(plan.launch) == 1


def test_raising_nodes_grows_a_running_job_at_once_despite_the_cooldown():
    """An edit is the user's decision: not held by resources.resizeCooldownSeconds, which
    rate-limits only the operator's own grows when capacity returns."""
    body = job_body({"resources.minNodes": 1, "resources.resizeCooldownSeconds": 600})
    body, _ = launch(body, 0, TWO)
    body = apply(body, reconcile.plan(body, gang(body, 2, 0), at(5), cluster_nodes=TWO))
    edited = copy.deepcopy(body)
    edited["spec"]["resources"]["nodes"], edited["metadata"]["generation"] = 1, 2
    body, _ = launch(apply(edited, reconcile.plan(edited, gang(body, 2, 0), at(20), cluster_nodes=TWO)), 22, TWO)
    running = gang(body, 1, 1)
    body = apply(body, reconcile.plan(body, running, at(25), cluster_nodes=TWO))
    assert body["status"]["nodes"] == 1
    plan = reconcile.plan(body, running, at(40), cluster_nodes=TWO)   # nothing edited: no grow in the cooldown
    assert not plan.delete_pods
    body["spec"]["resources"]["nodes"], body["metadata"]["generation"] = 2, 3
    plan = reconcile.plan(body, running, at(41), cluster_nodes=TWO)
    assert plan.delete_pods == ["tiny-node-0"] and plan.status["nodes"] == 2
    assert plan.status["resizes"]["lastReason"] == "SpecChanged"


def test_no_resize_during_the_final_export():
    body = job_body({"resources.minNodes": 1, "resources.resizeCooldownSeconds": 0})
    body, _ = launch(body, 0, ONE)
    running = gang(body, 1, 0)
    body = apply(body, reconcile.plan(body, running, at(5), cluster_nodes=ONE))
    body["status"]["progress"] = {"step": 20, "totalSteps": 20}
    assert not reconcile.plan(body, running, at(100), cluster_nodes=TWO).delete_pods
    body["status"]["progress"] = {"step": 10, "totalSteps": 20}
    assert reconcile.plan(body, running, at(100), cluster_nodes=TWO).delete_pods == ["tiny-node-0"]
