"""Acceptance tests of the SFTJob operator on the local cluster, with real trainer pods.

The operator runs as a real process (`sftjob-operator --all-namespaces`); the trainer pods
run in containers on the local cluster's kubelets, on the tiny assets in its MinIO. Tests that take
the operator down at random points (acceptance 6) do it during the preemption and suspend
runs, and then check that no second gang ever ran beside the first and that no status
counter ever went backwards.
"""
from __future__ import annotations

import copy
import json
import re
import statistics
import time

import pytest
from sftjob_contract import layout

from tests.fixtures.cluster import wait_for

from .cluster_kit import (EXAMPLE, RESUMABLE, Chaos, Recorder, apply, checkpointed, condition, diagnose, example,
                          get_job, live, phase_is, pods_of, refusals, wait_job)

pytestmark = pytest.mark.cluster


# ---------------------------------------------------------------------------------- tests

def test_example_runs_to_success_and_shows_progress(cluster, operator, example_ns):
    """Acceptance 1: the example as written reaches Succeeded; kubectl get shows progress."""
    ns = example_ns
    cluster.kubectl("-n", ns, "apply", "-f", str(EXAMPLE))
    rec = Recorder(cluster, ns, "tiny-lora")
    rec.start()
    chaos = Chaos(operator, seed=int(time.time()) + 2)
    chaos.start()
    seen = []

    def progress_line(job):
        out = cluster.kubectl("-n", ns, "get", "sft", "tiny-lora", "--no-headers").stdout
        if "/40" in out:
            seen.append(out.strip())
        return job if job.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    try:
        job = wait_job(cluster, ns, "tiny-lora", operator, progress_line, timeout=900, what="example to finish")
    finally:
        chaos.stop()
        rec.stop()
    assert job["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "tiny-lora", operator)
    rec.check_invariants(nodes=2)
    print(f"operator killed {chaos.kills} times")
    assert seen, "kubectl get sft never showed step/total while running"
    print("kubectl get sft while running:", seen[len(seen) // 2])
    uri = job["status"]["output"]["uri"]
    assert uri.startswith("s3://sftjob-examples/runs/") and uri.endswith("/hf/final")
    bucket, key = uri[len("s3://"):].split("/", 1)
    s3 = cluster.s3()
    assert s3.head_object(Bucket=bucket, Key=f"{key}/config.json")
    assert condition(job, "Ready")["status"] == "True"
    assert job["status"]["restarts"] == {"failures": 0, "preemptions": 0, "total": 0}
    assert job["status"]["progress"]["step"] == 40
    sources = job["status"]["progress"].get("sources") or []   # the trainer's preflight report, in status
    assert [s["name"] for s in sources] == ["train"] and 0 < sources[0]["usableRows"] <= sources[0]["rows"], sources
    assert not live(pods_of(cluster, ns, "tiny-lora"))


def test_deleted_pod_restarts_gang_and_resumes(cluster, operator, example_ns):
    """Acceptance 2 (+6): a deleted pod restarts the gang as a preemption, training resumes
    from the checkpoint and succeeds, while the operator is killed at random moments."""
    ns, name = example_ns, "preempted"
    apply(cluster, ns, example(name, **RESUMABLE))
    rec = Recorder(cluster, ns, name)
    rec.start()
    chaos = Chaos(operator, seed=int(time.time()))
    try:
        job = wait_job(cluster, ns, name, operator, checkpointed(5), what="a committed checkpoint")
        chaos.start()
        ckpt = job["status"]["progress"]["lastCheckpointStep"]
        cluster.kubectl("-n", ns, "delete", "pod", f"{name}-node-1", "--wait=false")
        wait_job(cluster, ns, name, operator,
                 lambda j: j if j.get("status", {}).get("restarts", {}).get("preemptions") == 1 else None,
                 timeout=120, what="the preemption to be counted")
        job = wait_job(cluster, ns, name, operator, phase_is("Succeeded", "Failed"), timeout=900, what="success")
    finally:
        chaos.stop()
        rec.stop()
    assert job["status"]["phase"] == "Succeeded", diagnose(cluster, ns, name, operator)
    restarts = job["status"]["restarts"]
    # Exactly 1 right after the deletion (waited for above). On a cluster shared with other
    # suites a simulated node loss can preempt the job once more; that must also count as a
    # preemption, never as a failure.
    assert restarts["failures"] == 0 and restarts["preemptions"] >= 1, restarts
    assert restarts["total"] == restarts["preemptions"]
    print(f"operator killed {chaos.kills} times; checkpoint before deletion: step {ckpt}; restarts {restarts}")
    rec.check_invariants(nodes=2)
    after = [s.get("progress", {}).get("step") for _, s, _ in rec.samples if s.get("attempt", 0) >= 1
             and s.get("phase") == "Running"]
    assert all(step is None or step >= ckpt for step in after), f"step went back below {ckpt}: {after}"
    assert "resumed from" in cluster.pod_log(ns, f"{name}-node-0")


def test_bad_data_fails_at_once_without_retrying(cluster, operator, example_ns):
    """Exit 2 (missing column) fails the job at once with the trainer's reason, without a
    retry that could not help and without spending backoffLimit; no pod is left running."""
    ns, name = example_ns, "bad-data"
    apply(cluster, ns, example(name, **{"data.promptKey": "no_such_column", "runPolicy.backoffLimit": 1,
                                        "runPolicy.restartBackoffSeconds": 1}))
    rec = Recorder(cluster, ns, name)
    rec.start()
    chaos = Chaos(operator, seed=int(time.time()) + 3)
    chaos.start()
    try:
        job = wait_job(cluster, ns, name, operator, phase_is("Failed", "Succeeded"), timeout=600, what="failure")
    finally:
        chaos.stop()
        rec.stop()
    rec.check_invariants(nodes=2)
    assert job["status"]["phase"] == "Failed"
    failed = condition(job, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidData", failed
    assert "no_such_column" in failed["message"] and "retrying cannot help" in failed["message"]
    assert job["status"]["restarts"]["failures"] == 0 and job["status"]["restarts"]["preemptions"] == 0
    assert job["status"]["attempt"] == 0  # one gang only
    wait_for(lambda: not live(pods_of(cluster, ns, name)), 120, what="no running pods")
    events = cluster.kubectl("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}",
                             "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    # Events are best effort (posted after the status write; an operator killed in between
    # skips them): the status above is the record, events only need to tell the story.
    assert "RestartingAfterFailure" not in reasons, reasons


def test_suspend_and_resume(cluster, operator, example_ns):
    """Acceptance 4 (+6): suspend stops the pods (phase Suspended); resume continues from
    the checkpoint the suspend itself asked for before the pods were deleted, to success,
    with the operator killed at random moments. No periodic checkpoint is configured, so a
    resume past step 0 proves a suspend checkpoint, and the Event names the requested one."""
    ns, name = example_ns, "suspended"
    apply(cluster, ns, example(name, **{**RESUMABLE, "checkpoint.interval": 0, "checkpoint.intervalSeconds": 0}))
    rec = Recorder(cluster, ns, name)
    rec.start()
    chaos = Chaos(operator, seed=int(time.time()) + 1)
    try:
        wait_job(cluster, ns, name, operator,
                 lambda j: j if ((j.get("status") or {}).get("progress") or {}).get("step", 0) >= 3 else None,
                 what="training steps")
        chaos.start()
        cluster.kubectl("-n", ns, "patch", "sft", name, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait_job(cluster, ns, name, operator, phase_is("Suspended"), timeout=120, what="Suspended")
        wait_for(lambda: not pods_of(cluster, ns, name), 120, what="pods gone")
        stepped = get_job(cluster, ns, name)["status"]["progress"].get("step", 0)
        cluster.kubectl("-n", ns, "patch", "sft", name, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        job = wait_job(cluster, ns, name, operator, phase_is("Succeeded", "Failed"), timeout=900, what="success")
    finally:
        chaos.stop()
        rec.stop()
    assert job["status"]["phase"] == "Succeeded", diagnose(cluster, ns, name, operator)
    assert job["status"]["restarts"]["total"] == 0
    rec.check_invariants(nodes=2)
    resumed = re.search(rf"resumed from s3://\S+/{layout.CHECKPOINTS}/step-(\d+) ",
                        cluster.pod_log(ns, f"{name}-node-0"))
    assert resumed, "the resumed gang found no checkpoint: the suspend did not take one"
    ckpt = int(resumed.group(1))
    assert ckpt >= max(3, stepped), (ckpt, stepped)   # the suspend's own checkpoint: none is periodic
    # ... and it is the one the operator asked for before deleting the pods (stop_request.py),
    # not SIGTERM's: the trainer held after it, so the stop wrote none later.
    asked = [re.search(r"checkpoint step-(\d+) committed on request", e.get("message") or "")
             for e in cluster.kube.get(f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3D{name}")
             ["items"] if e.get("reason") == "CheckpointedBeforeStop"]
    assert [int(m.group(1)) for m in asked if m] == [ckpt], diagnose(cluster, ns, name, operator)
    print(f"operator killed {chaos.kills} times; resumed from step {ckpt}, checkpointed on request")


def test_deleting_job_removes_children(cluster, operator, namespace):
    """Acceptance 7: owner references garbage-collect every child; no finalizer is involved."""
    ns, name = namespace, "deleted"
    apply(cluster, ns, example(name, **{"resources.nodeSelector": {"sftjob.io/no-such-node": "x"}}))
    wait_for(lambda: len(pods_of(cluster, ns, name)) == 2, 60, what="pods created")
    assert not get_job(cluster, ns, name)["metadata"].get("finalizers")
    cluster.kubectl("-n", ns, "delete", "sft", name, "--wait=true", "--timeout=60s")
    for path in (f"/api/v1/namespaces/{ns}/services/{name}", f"/api/v1/namespaces/{ns}/configmaps/{name}-config"):
        cluster.wait_gone(path, 60)
    wait_for(lambda: not pods_of(cluster, ns, name), 60, what="pods garbage-collected")


def test_apply_to_all_pods_created_latency(cluster, operator, namespace):
    """Apply -> all pods exist, over 20 two-node jobs (pods pinned to no node, so only the
    operator's work is measured, not the trainer's start-up)."""
    ns, lat, after_apply = namespace, [], []
    for i in range(20):
        name = f"lat-{i}"
        obj = example(name, **{"resources.nodeSelector": {"sftjob.io/no-such-node": "x"}})
        t0 = time.monotonic()
        apply(cluster, ns, obj)
        t1 = time.monotonic()
        wait_for(lambda: len(pods_of(cluster, ns, name)) == 2, 60, interval=0.05,  # noqa: B023 - polled now
                 what=f"pods of {name}")
        lat.append(time.monotonic() - t0)
        after_apply.append(time.monotonic() - t1)
    p50 = statistics.median(lat)
    print(f"apply->all-pods-created over {len(lat)} jobs: p50 {p50:.2f}s, max {max(lat):.2f}s; "
          f"from kubectl's return: p50 {statistics.median(after_apply):.2f}s")
    assert p50 < 10
    # The operator's own metrics saw the same 20 pending jobs and 40 pods.
    def pending_gauge_at_20():
        text = operator.metrics()
        return text if 'sftjob_operator_jobs{phase="Pending"} 20.0' in text else None

    text = wait_for(pending_gauge_at_20, 30, what="jobs gauge at 20 pending")
    created = next(line for line in text.splitlines() if line.startswith("sftjob_operator_pods_created_total "))
    assert float(created.split()[1]) >= 40


INVALID = [
    ("missing model", {"model": None}, "spec.model: Required value"),
    ("missing model path", {"model.path": None}, "spec.model.path: Required value"),
    ("missing train files", {"data.trainFiles": None}, "spec.data.trainFiles: Required value"),
    ("empty train files", {"data.trainFiles": []}, "spec.data.trainFiles"),
    ("micro-batch does not divide batch", {"data.trainBatchSize": 6}, "spec.data.trainBatchSize"),
    ("negative nodes", {"resources.nodes": -1}, "spec.resources.nodes"),
    ("zero processes", {"resources.processesPerNode": 0}, "spec.resources.processesPerNode"),
    ("bad model URI scheme", {"model.path": "http://example.com/m"}, "spec.model.path"),
    ("bad data URI scheme", {"data.trainFiles": ["gs://b/train.parquet"]}, "spec.data.trainFiles[0]"),
    ("bad storage URI scheme", {"storage.uri": "hdfs://x/y"}, "spec.storage.uri"),
    ("credentials inline", {"storage.accessKeyId": "AKIA0000"}, 'unknown field "spec.storage.accessKeyId"'),
    ("secret key inline", {"storage.credentialsSecretRef.secretAccessKey": "s"},
     'unknown field "spec.storage.credentialsSecretRef.secretAccessKey"'),
    ("zero learning rate", {"training.optim.lr": 0}, "spec.training.optim.lr"),
    ("unknown scheduler", {"training.optim.lrScheduler": "linear"}, "spec.training.optim.lrScheduler"),
    ("negative LoRA rank", {"training.lora.rank": -8}, "spec.training.lora.rank"),
    ("bad truncation", {"data.truncation": "middle"}, "spec.data.truncation"),
    ("negative backoff limit", {"runPolicy.backoffLimit": -1}, "spec.runPolicy.backoffLimit"),
    ("bad clean pod policy", {"runPolicy.cleanPodPolicy": "Sometimes"}, "spec.runPolicy.cleanPodPolicy"),
    ("zero steps", {"training.totalTrainingSteps": 0}, "spec.training.totalTrainingSteps"),
    ("endpoint without s3", {"storage.uri": "/data/runs"}, "spec.storage.endpoint"),
    ("bad secret name", {"storage.credentialsSecretRef.name": "Not_A_Name"}, "spec.storage.credentialsSecretRef.name"),
    ("typo in a section", {"checkpoint.intervall": 5}, 'unknown field "spec.checkpoint.intervall"'),
    ("minNodes above nodes", {"resources.minNodes": 3}, "spec.resources.minNodes"),
    ("batch does not divide at minNodes", {"resources.nodes": 3, "resources.minNodes": 2, "data.trainBatchSize": 384},
     "data-parallel size at resources.minNodes"),
    ("sequence parallel does not divide", {"training.sequenceParallelSize": 3}, "spec.training.sequenceParallelSize"),
    ("cpu offload on a CPU job", {"training.cpuOffload": True}, "spec.training.cpuOffload"),
    ("unknown FSDP gather", {"training.fsdpGather": "always"}, "spec.training.fsdpGather"),
    ("per-step gather with CPU offload", {"resources.gpusPerNode": 1, "training.cpuOffload": True,
                                          "training.fsdpGather": "per_step"}, "spec.training.fsdpGather"),
    ("Liger on a CPU job", {"model.ligerKernel": True}, "spec.model.ligerKernel"),
    ("early stopping without validation", {"training.earlyStoppingPatience": 2, "training.testFreq": 0},
     "spec.training.earlyStoppingPatience"),
    ("best export without validation", {"output.export": "best", "data.valFiles": []}, "spec.output.export"),
    ("non-http MLflow URI", {"tracking.mlflow.trackingUri": "ftp://mlflow:5000"}, "spec.tracking.mlflow.trackingUri"),
    ("MLflow URI without a host", {"tracking.mlflow.trackingUri": "http:///api"}, "spec.tracking.mlflow.trackingUri"),
    ("MLflow token inline", {"tracking.mlflow.trackingUri": "http://m:5000", "tracking.mlflow.token": "t"},
     'unknown field "spec.tracking.mlflow.token"'),
    ("W&B API key inline", {"tracking.wandb.apiKey": "k"}, 'unknown field "spec.tracking.wandb.apiKey"'),
    ("bad W&B mode", {"tracking.wandb.mode": "cloud"}, "spec.tracking.wandb.mode"),
    ("bad tracking Secret name", {"tracking.wandb.apiKeySecret": "Not_A_Name"}, "spec.tracking.wandb.apiKeySecret"),
    ("train files and sources", {"data.sources": [{"files": ["s3://sftjob-examples/data/chat.jsonl"]}]},
     "spec.data.sources: Forbidden"),
    ("zero source weight", {"data.trainFiles": None, "data.sources": [
        {"files": ["s3://sftjob-examples/data/train.parquet"], "weight": 0}]}, "spec.data.sources[0].weight"),
    ("unknown source format", {"data.trainFiles": None, "data.sources": [
        {"files": ["s3://sftjob-examples/data/train.csv"], "format": "csv"}]}, "spec.data.sources[0].format"),
    ("bad source URI scheme", {"data.trainFiles": None, "data.sources": [{"files": ["gs://b/x.jsonl"]}]},
     "spec.data.sources[0].files[0]"),
]


def test_invalid_specs_are_rejected_naming_the_field(cluster, crd, namespace):
    """Acceptance 5: kubectl apply refuses each invalid SFTJob with the field's name."""
    failures = refusals(cluster, namespace, INVALID, "invalid")
    bad_name = example("x" * 60)
    res = apply(cluster, namespace, bad_name, check=False)
    if res.returncode == 0 or "metadata.name" not in res.stderr:
        failures.append(f"long name: {res.stderr.strip()[:300]}")
    assert not failures, "\n".join(failures)
    assert len(INVALID) >= 15


def test_immutable_fields_are_rejected_on_update(cluster, crd, namespace):
    """CEL transition rules: what cannot change mid-run is refused with the field's name."""
    obj = example("immutable", suspend=True)
    apply(cluster, namespace, obj)
    for path, value, expected in (("model.path", "s3://sftjob-examples/models/other", "model is immutable"),
                                  ("resources.processesPerNode", 2, "resources.processesPerNode is immutable"),
                                  ("training.optim.lr", 0.5, "training is immutable")):
        changed = copy.deepcopy(obj)
        node = changed["spec"]
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
        if path == "resources.processesPerNode":  # still whole micro-batches per rank: only immutability is wrong
            changed["spec"]["data"]["trainBatchSize"] = 4 * changed["spec"]["data"]["microBatchSizePerGpu"]
        res = apply(cluster, namespace, changed, check=False)
        assert res.returncode != 0 and expected in res.stderr, (path, res.stderr)
    ok = copy.deepcopy(obj)
    ok["spec"]["runPolicy"]["backoffLimit"] = 5  # run policy may change
    ok["spec"]["resources"]["nodes"] = 1           # and the size (an elastic resize, from Git as well)
    apply(cluster, namespace, ok)
