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
        localcluster.node_restore(node)
        cluster.kubectl("uncordon", node)
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
    assert shrink_s < 60, f"{shrink_s:.0f}s from noticing the lost node to training at 1 pod"
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
