"""Shared test data: SFTJob bodies and pod snapshots as the API server would return them."""
from __future__ import annotations

import copy
from datetime import datetime, timedelta, UTC
from typing import Any

from sftjob_operator import builders, reconcile
from sftjob_operator.plan import Plan

UID = "0f5c1a52-6a1e-4f0e-9d4e-3c1f7c8d2b10"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def job_body(spec_overrides: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
             name: str = "tiny", namespace: str = "team-a") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "s3://models/tiny"},
        "data": {"trainFiles": ["s3://data/train.parquet"], "trainBatchSize": 4, "microBatchSizePerGpu": 1},
        "training": {"totalTrainingSteps": 20, "lora": {"rank": 8}},
        "resources": {"nodes": 2, "processesPerNode": 1},
        "storage": {"uri": "s3://runs", "endpoint": "http://minio:9000",
                    "credentialsSecretRef": {"name": "s3-credentials"}},
        "checkpoint": {"interval": 5},
        "runPolicy": {"backoffLimit": 1, "preemptionLimit": 2, "restartBackoffSeconds": 10,
                      "terminationGracePeriodSeconds": 40},
    }
    for path, value in (spec_overrides or {}).items():
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    body = {
        "apiVersion": "sftjob.io/v1alpha1", "kind": "SFTJob",
        "metadata": {"name": name, "namespace": namespace, "uid": UID, "generation": 1,
                     "resourceVersion": "1"},
        "spec": spec,
    }
    if status is not None:
        body["status"] = status
    return body


def pods_for(body: dict[str, Any], attempt: int = 0, phase: str = "Running") -> list[dict[str, Any]]:
    """The pods a launch would create, observed in `phase`."""
    job = builders.JobRef.from_body(body)
    spec = builders.parse_spec(body["spec"])
    return observe(builders.build_pods(job, spec, attempt), phase)


def observe(pods: list[dict[str, Any]], phase: str = "Running") -> list[dict[str, Any]]:
    """Copies of created pods as the API server shows them once scheduled (rank i on node-i)."""
    pods = copy.deepcopy(pods)
    for i, p in enumerate(pods):
        p["spec"]["nodeName"] = f"node-{i}"
        p["status"] = {"phase": phase, "podIP": f"10.0.0.{i + 1}"}
        if phase == "Running":
            p["status"]["containerStatuses"] = [{"name": "trainer", "state": {"running": {}}}]
    return pods


def at(seconds: float) -> datetime:
    """The clock of the reconcile tests: T0 plus seconds."""
    return T0 + timedelta(seconds=seconds)


def running_job(**spec):
    """A job whose attempt-0 gang is launched and running, and its pods."""
    body = job_body(spec)
    plan = reconcile.plan(body, [], at(0))
    body = apply(body, plan)
    pods = pods_for(body)
    plan = reconcile.plan(body, pods, at(5))
    assert body["status"]["phase"] == "Pending" and plan.status["phase"] == "Running"
    return apply(body, plan), pods


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def terminated(pod: dict[str, Any], exit_code: int, message: str = "", reason: str = "Error") -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["status"] = {"phase": "Succeeded" if exit_code == 0 else "Failed",
                     "containerStatuses": [{"name": "trainer", "state": {"terminated": {
                         "exitCode": exit_code, "reason": reason, "message": message}}}]}
    return pod


def apply(body: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The job as the API server holds it after the handler applied `plan`'s status writes."""
    body = copy.deepcopy(body)
    if plan.status is not None:
        body["status"] = copy.deepcopy(plan.status)
    if plan.launch and plan.launched_status:
        body.setdefault("status", {}).update(plan.launched_status)
    return body
