"""Elastic jobs on the two real kubelets (issue 25's acceptance): a node lost mid-run and
cordoned, the job resumes at 1 pod instead of waiting; the node back, it grows to 2 at a
checkpoint; it succeeds with two resizes, no failure, and every sample used once per epoch
across both size changes (the trainer logs each step's sample ids)."""
from __future__ import annotations

import json
import time

import pytest

from hack import localcluster
from sftjob_contract import layout

from .cluster_kit import apply, condition, diagnose, example, get_job, phase_is, pods_of, wait_job

pytestmark = pytest.mark.cluster
STEPS = 160


def _status(job):
    return job.get("status") or {}


def _steps_logged(cluster, checkpoints_uri: str) -> dict[int, list[int]]:
    """Each step's sample ids from the job's metrics.jsonl (a redone step: its last record)."""
    bucket, _, key = checkpoints_uri.removeprefix("s3://").partition("/")
    key = key.rsplit("/", 1)[0] + "/" + layout.METRICS_FILE
    body = cluster.s3().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    steps: dict[int, list[int]] = {}
    for line in body.splitlines():
        row = json.loads(line)
        if "sample_ids" in row:
            steps[row["step"]] = row["sample_ids"]
    return steps


def _at(nodes: int):
    def pred(job):
        st = _status(job)
        return job if st.get("nodes") == nodes and st.get("phase") == "Running" else None
    return pred


def test_elastic_job_shrinks_on_a_lost_node_and_grows_back(cluster, operator, example_ns):
    ns, name = example_ns, "elastic"
    apply(cluster, ns, example(name, **{
        "resources.minNodes": 1, "resources.resizeCooldownSeconds": 20, "checkpoint.interval": 5,
        "data.valFiles": [], "training.testFreq": 0, "training.totalTrainingSteps": STEPS,
        "training.logSampleIds": True, "runPolicy.backoffLimit": 0}))
    job = wait_job(cluster, ns, name, operator,
                   lambda j: j if (_status(j).get("progress") or {}).get("step", 0) >= 3 else None,
                   timeout=300, what="training steps at 2 pods")
    assert _status(job)["nodes"] == 2
    victim = next(p for p in pods_of(cluster, ns, name) if p["metadata"]["name"].endswith("-node-1"))
    node = victim["spec"]["nodeName"]
    cluster.kubectl("cordon", node)
    try:
        localcluster.node_lost(node)
        wait_job(cluster, ns, name, operator,
                 lambda j: j if (_status(j).get("restarts") or {}).get("preemptions", 0) >= 1 else None,
                 timeout=180, what="the lost node noticed (a preemption)")
        noticed = time.monotonic()
        job = wait_job(cluster, ns, name, operator, _at(1), timeout=180, what="running at 1 pod")
        shrink_s = time.monotonic() - noticed
        assert (_status(job).get("resizes") or {}).get("lastReason") == "CapacityLost", _status(job)
        step_at_1 = (_status(job).get("progress") or {}).get("step")
    finally:
        try:
            localcluster.node_restore(node)
        finally:
            cluster.kubectl("uncordon", node)   # never leave the shared cluster a node short
    restored = time.monotonic()
    job = wait_job(cluster, ns, name, operator, _at(2), timeout=300, what="grown back to 2 pods")
    grow_s = time.monotonic() - restored
    assert (_status(job).get("resizes") or {}).get("lastReason") == "CapacityReturned", _status(job)
    job = wait_job(cluster, ns, name, operator, phase_is("Succeeded", "Failed"), timeout=900, what="success")
    st = _status(job)
    assert st["phase"] == "Succeeded", diagnose(cluster, ns, name, operator)
    assert st["restarts"]["failures"] == 0 and st["resizes"]["count"] == 2, st
    print(f"elastic timeline: running at 1 pod {shrink_s:.0f}s after the lost node was noticed (step "
          f"{step_at_1}); at 2 pods again {grow_s:.0f}s after the node returned (cooldown 20 s); restarts "
          f"{st['restarts']}, resizes {st['resizes']['count']}")
    # The acceptance: within 60 s. It measured 48-61 s while the lost node's pod was waited for
    # (its grace period and 30 s more, stale.py); force-deleted at once, make chaos measured 8 s.
    assert shrink_s < 60, f"{shrink_s:.0f}s from noticing the lost node to running at 1 pod"
    # Every sample once per epoch, across both resizes.
    steps = _steps_logged(cluster, st["output"]["checkpointsUri"])
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(set(range(1, STEPS + 1)) - set(steps))
    batch = len(steps[1])
    per_epoch = len({i for ids in steps.values() for i in ids}) // batch
    for first in range(1, STEPS - per_epoch + 2, per_epoch):
        ids = [i for s in range(first, first + per_epoch) for i in steps[s]]
        assert len(ids) == len(set(ids)) == per_epoch * batch, f"a sample repeated in the epoch from step {first}"
    assert condition(job, "Ready")["reason"] == "TrainingSucceeded"
    assert get_job(cluster, ns, name)["status"]["nodes"] == 2


def test_editing_nodes_resizes_at_a_requested_checkpoint_by_apply_and_by_patch(cluster, operator, example_ns):
    """Issue 25's GitOps acceptance: `kubectl apply` of the file with `nodes: 1` shrinks a
    running 2-pod job, `kubectl patch` back to 2 grows it. No periodic checkpoint is set, so
    each resize resumes from the checkpoint it asked for (the CheckpointedBeforeStop Event
    names it), and no step is lost or redone out of order: every step logged once, in order."""
    ns, name = example_ns, "resized"
    steps = 300   # long enough at 1 pod to be resized back (60 finished at 1 pod before the patch landed)
    manifest = example(name, **{
        "resources.minNodes": 1, "checkpoint.interval": 0, "checkpoint.intervalSeconds": 0,
        "data.valFiles": [], "training.testFreq": 0, "training.totalTrainingSteps": steps,
        "training.logSampleIds": True, "runPolicy.backoffLimit": 0})
    apply(cluster, ns, manifest)
    wait_job(cluster, ns, name, operator,
             lambda j: j if (_status(j).get("progress") or {}).get("step", 0) >= 3 and _status(j).get("nodes") == 2
             else None, timeout=300, what="training at 2 pods")
    manifest["spec"]["resources"]["nodes"] = 1
    apply(cluster, ns, manifest)                 # the GitOps edit
    job = wait_job(cluster, ns, name, operator, _at(1), timeout=180, what="resized to 1 pod")
    assert _status(job)["resizes"]["lastReason"] == "SpecChanged", _status(job)
    wait_job(cluster, ns, name, operator,
             lambda j: j if (_status(j).get("progress") or {}).get("step", 0) >= _status(job)["progress"]["step"] + 2
             else None, timeout=180, what="training at 1 pod")
    cluster.kubectl("-n", ns, "patch", "sft", name, "--type=merge", "-p", '{"spec":{"resources":{"nodes":2}}}')
    job = wait_job(cluster, ns, name, operator, _at(2), timeout=180, what="resized back to 2 pods")
    job = wait_job(cluster, ns, name, operator, phase_is("Succeeded", "Failed"), timeout=600, what="success")
    st = _status(job)
    assert st["phase"] == "Succeeded", diagnose(cluster, ns, name, operator)
    assert st["resizes"]["count"] == 2 and st["restarts"]["total"] == 0, st
    events = cluster.kube.get(f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3D{name}")["items"]
    asked = [e["message"] for e in events if e.get("reason") == "CheckpointedBeforeStop"]
    assert len(asked) == 2, [(e.get("reason"), e.get("message")) for e in events]
    logged = _steps_logged(cluster, st["output"]["checkpointsUri"])
    assert sorted(logged) == list(range(1, steps + 1))
    print(f"resized by apply and by patch, each at the checkpoint it asked for: {asked}")
