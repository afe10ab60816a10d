"""A job whose status this operator version cannot read is reported on that job, and never
keeps the other jobs from their passes (it stopped the periodic resync of every job listed
after it)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sftjob_operator import handlers
from sftjob_operator.runtime import Runtime

pytestmark = pytest.mark.unit


def _job(name: str, st: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "sftjob.io/v1alpha1", "kind": "SFTJob", "status": st,
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"}}


class FakeKube:
    """The few API calls these paths make, over an in-memory list of jobs."""

    def __init__(self, jobs: list[dict[str, Any]]):
        self.jobs = {j["metadata"]["name"]: j for j in jobs}
        self.events: list[tuple[str, str, str, str]] = []

    async def list_jobs(self, namespaces):
        return list(self.jobs.values())

    async def get_job(self, namespace, name):
        return self.jobs.get(name)

    async def list_pods(self, namespace, name):
        return []

    async def post_event(self, body, type_, reason, message):
        self.events.append((body["metadata"]["name"], type_, reason, message))


def test_resync_queues_every_job_past_one_with_an_unreadable_status():
    kube = FakeKube([_job("a", {"phase": "Running"}), _job("bad", {"attempt": "two"}),
                     _job("c", {"phase": "Pending"})])
    rt = Runtime(kube=kube, namespaces=None)  # type: ignore[arg-type]
    asyncio.run(handlers.resync(rt))
    assert set(rt.queue.due) == {("ns", "a"), ("ns", "bad"), ("ns", "c")}


def test_an_unreadable_status_is_reported_on_the_job_and_retried_at_the_resync_pace():
    kube = FakeKube([_job("bad", {"attempt": "two", "phase": "Running"})])
    rt = Runtime(kube=kube, namespaces=None)  # type: ignore[arg-type]
    asyncio.run(handlers.reconcile_job(rt, "ns", "bad"))   # does not raise
    [(name, type_, reason, message)] = kube.events
    assert (name, type_, reason) == ("bad", "Warning", "InvalidStatus")
    assert "status.attempt" in message
    assert rt.queue.due[("ns", "bad")] - time.monotonic() > handlers.RESYNC_S - 5  # not every 5 s
