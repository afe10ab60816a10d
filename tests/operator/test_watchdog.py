"""The hang watchdog on the real cluster: a rank frozen mid-run (SIGSTOP, as a rank stuck in
a collective would look from outside) no longer holds the job until gloo's 30-minute
timeout; after runPolicy.progressDeadlineSeconds the gang restarts as a failure, resumes
from its checkpoint and succeeds."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.fixtures.cluster import wait_for

from .cluster_kit import RESUMABLE, apply, checkpointed, example, wait_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def trainer_pids(job: str, rank: int) -> list[int]:
    """Host PIDs of one rank's processes (containers' processes are host processes, in their
    own namespaces)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SFTJOB_JOB_NAME={job}".encode() in env and f"NODE_RANK={rank}".encode() in env:
            pids.append(int(proc.name))
    return pids


def test_frozen_rank_is_restarted_by_the_progress_deadline(cluster, scoped_operator, example_ns):
    ns, name = example_ns, "hung"
    apply(cluster, ns, example(name, **{**RESUMABLE, "runPolicy.progressDeadlineSeconds": 60}))
    wait_job(cluster, ns, name, scoped_operator, checkpointed(5), 600, what="a first checkpoint")
    frozen = trainer_pids(name, 1)
    assert frozen, "no trainer process of rank 1 found"
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        job = wait_job(cluster, ns, name, scoped_operator,
                       lambda j: j if j["status"].get("restarts", {}).get("failures") else None,
                       240, what="the watchdog's restart")
    finally:
        for pid in frozen:  # let the kubelet's SIGTERM/SIGKILL reach them
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert job["status"]["restarts"] == {"failures": 1, "preemptions": 0, "total": 1}
    # the operator writes the status first and posts the pass's Events after its pod deletions
    wait_for(lambda: any(e["reason"] == "ProgressDeadlineExceeded" for e in cluster.kube.get(
        f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3D{name}")["items"]), 30,
        what="the ProgressDeadlineExceeded Event")
    job = wait_job(cluster, ns, name, scoped_operator,
                   lambda j: j if j["status"].get("phase") in ("Succeeded", "Failed") else None, 600,
                   what="the resumed job to finish")
    assert job["status"]["phase"] == "Succeeded", job["status"].get("message")
    log = cluster.pod_log(ns, f"{name}-node-0")
    assert "resumed from" in log
