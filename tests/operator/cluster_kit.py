"""Helpers for the operator's tests on the local cluster: the example SFTJob with overrides,
kubectl apply, reading jobs and pods, waiting with a diagnosis, and the invariant recorder."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.cluster import wait_for

from hack.localcluster.operator_proc import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "sftjob.io_sftjobs.yaml"
EXAMPLE = REPO / "examples" / "sftjob.yaml"
JOBS = "/apis/sftjob.io/v1alpha1/namespaces/{ns}/sftjobs"

def example(name: str, **overrides: Any) -> dict[str, Any]:
    """examples/sftjob.yaml with a new name and dotted spec overrides (None deletes)."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["name"] = name
    for path, value in overrides.items():
        node = obj["spec"]
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj


def apply(cluster, ns: str, obj: dict[str, Any], check: bool = True):
    return cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(obj), check=check)


def get_job(cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.kube.get(f"{JOBS.format(ns=ns)}/{name}")


def pods_of(cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return cluster.kube.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=sftjob.io/job-name%3D{name}")["items"]


def live(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]


def diagnose(cluster, ns: str, name: str, op: OperatorProcess) -> str:
    try:
        st = json.dumps(get_job(cluster, ns, name).get("status"), indent=1)[-3000:]
    except Exception as err:  # noqa: BLE001 - shown in the diagnosis instead
        st = repr(err)
    logs = "".join(f"\n--- {p['metadata']['name']}:\n{cluster.pod_log(ns, p['metadata']['name'])[-1500:]}"
                   for p in pods_of(cluster, ns, name))
    return f"status: {st}\npods:{logs}\noperator:\n{op.tail(3000)}"


def wait_job(cluster, ns, name, op, pred, timeout=600, what="condition"):
    try:
        return wait_for(lambda: pred(get_job(cluster, ns, name)), timeout, interval=0.5, what=what)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{diagnose(cluster, ns, name, op)}") from None


def phase_is(*phases):
    return lambda job: job if job.get("status", {}).get("phase") in phases else None


def condition(job, ctype):
    return next((c for c in job["status"].get("conditions", []) if c["type"] == ctype), None)


class Recorder(threading.Thread):
    """Samples the job and its pods until stopped, to check invariants afterwards."""

    def __init__(self, cluster, ns: str, name: str):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.name = cluster, ns, name
        self.samples: list[tuple[float, dict, list]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                job = get_job(self.cluster, self.ns, self.name)
                pods = pods_of(self.cluster, self.ns, self.name)
                self.samples.append((time.time(), job.get("status", {}), pods))
            except Exception:  # noqa: BLE001 - a sample lost to an API hiccup is fine
                pass
            self.stopped.wait(0.5)

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)

    def check_invariants(self, nodes: int) -> None:
        last = {"failures": 0, "preemptions": 0, "attempt": 0}
        for t, status, pods in self.samples:
            running = live(pods)
            assert len(running) <= nodes, \
                f"more live pods than ranks at {t}: {[p['metadata']['name'] for p in running]}"
            attempts = {p["metadata"]["labels"]["sftjob.io/attempt"] for p in running}
            assert len(attempts) <= 1, f"two gangs alive at once at {t}: {attempts}"
            now = {**status.get("restarts", {}), "attempt": status.get("attempt", 0)}
            for key, before in last.items():
                assert now.get(key, 0) >= before, f"status {key} went back from {before} to {now.get(key)} at {t}"
                last[key] = now.get(key, 0)


class Chaos(threading.Thread):
    """Kills the operator (SIGKILL) at random moments and starts it again."""

    def __init__(self, op: OperatorProcess, seed: int):
        super().__init__(daemon=True)
        self.op, self.rng, self.kills = op, random.Random(seed), 0
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.rng.uniform(2.0, 10.0)):
                self.op.kill()
                self.kills += 1
                time.sleep(self.rng.uniform(0.0, 2.0))
                self.op.start()
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            self.error = err

    def stop(self) -> None:
        self.stopped.set()
        self.join(90)
        if self.op.proc is None or self.op.proc.poll() is not None:
            self.op.start()
        assert self.error is None, self.error


# Restart tests checkpoint often and skip validation to stay short (LoRA, as in the example).
RESUMABLE = {"checkpoint.interval": 5, "data.valFiles": [], "training.testFreq": 0,
             "training.totalTrainingSteps": 60}


def checkpointed(step: int):
    return lambda job: job if job.get("status", {}).get("phase") == "Running" and \
        job["status"].get("progress", {}).get("lastCheckpointStep", 0) >= step else None


def refusals(cluster, ns: str, cases: list[tuple[str, dict[str, Any], str]], prefix: str) -> list[str]:
    """Apply each (what, overrides, expected) variant of the example; the ones the API server
    accepted, or refused without `expected` (the field's name) in its message."""
    failures = []
    for i, (what, overrides, expected) in enumerate(cases):
        res = apply(cluster, ns, example(f"{prefix}-{i}", **overrides), check=False)
        if res.returncode == 0 or expected not in res.stderr:
            failures.append(f"{what}: rc={res.returncode} stderr={res.stderr.strip()[:400]}")
    return failures
