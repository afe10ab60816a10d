"""An elastic job under the real Kueue (issue 25, item 4): a ClusterQueue whose free quota fits
one pod admits the elastic job (`minNodes: 1, nodes: 2`) at 1 pod instead of leaving it queued
at 2, and the job grows to 2 once the quota frees. Each size is its own pod group."""
from __future__ import annotations

import time

import pytest

from sftjob_operator import queueing

from .cluster_kit import diagnose, phase_is, pods_of, wait_job
from .test_kueue_cluster import SHORT, kueue, kueue_state, queue, queued  # noqa: F401 (fixtures)
from .cluster_kit import apply

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _at(nodes: int):
    def pred(job):
        st = job.get("status") or {}
        return job if st.get("nodes") == nodes and st.get("phase") == "Running" else None
    return pred


def test_elastic_job_is_admitted_smaller_and_grows_when_quota_frees(cluster, scoped_operator, example_ns, queue):
    ns, op = example_ns, scoped_operator
    # One pod of a fixed-size job holds half the queue's quota for a while.
    apply(cluster, ns, queued("holder", queue, **{**SHORT, "resources.nodes": 1, "data.microBatchSizePerGpu": 128,
                                                   "training.totalTrainingSteps": 150}))
    wait_job(cluster, ns, "holder", op, phase_is("Running"), timeout=120, what="holder running")
    t0 = time.monotonic()
    apply(cluster, ns, queued("elastic", queue, **{**SHORT, "resources.minNodes": 1,
                                                    "resources.resizeCooldownSeconds": 5,
                                                    "training.totalTrainingSteps": 200}))
    try:
        job = wait_job(cluster, ns, "elastic", op, _at(1), timeout=180, what="admitted at 1 pod")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{kueue_state(cluster, ns)}") from None
    admitted_s = time.monotonic() - t0
    st = job["status"]
    assert st["resizes"]["lastReason"] == "NotAllScheduled" and "Kueue" in st["resizes"]["lastMessage"], st
    groups = {p["metadata"]["labels"][queueing.GROUP_LABEL] for p in pods_of(cluster, ns, "elastic")
              if not p["metadata"].get("deletionTimestamp")}
    assert len(groups) == 1 and not any(g.endswith("-a0") for g in groups), groups   # a new group for the new size
    holder = wait_job(cluster, ns, "holder", op, phase_is("Succeeded", "Failed"), timeout=400, what="holder done")
    assert holder["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "holder", op)
    freed = time.monotonic()
    job = wait_job(cluster, ns, "elastic", op, _at(2), timeout=300, what="grown to 2 once the quota freed")
    grown_s = time.monotonic() - freed
    job = wait_job(cluster, ns, "elastic", op, phase_is("Succeeded", "Failed"), timeout=600, what="elastic done")
    st = job["status"]
    assert st["phase"] == "Succeeded", diagnose(cluster, ns, "elastic", op)
    assert st["restarts"]["failures"] == 0 and st["resizes"]["count"] >= 2, st
    print(f"elastic under Kueue: admitted at 1 pod {admitted_s:.0f}s after apply; at 2 pods {grown_s:.0f}s after "
          f"the quota freed; resizes {st['resizes']['count']}")
