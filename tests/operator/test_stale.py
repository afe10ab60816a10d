"""Pods of an earlier gang, table-driven: wait for them, or force-delete on a lost node."""
from __future__ import annotations

import copy

import pytest
from .op_testkit import at, job_body, pods_for

from sftjob_operator import stale
from sftjob_operator.nodes import NodeReadiness

pytestmark = pytest.mark.unit
POD = pods_for(job_body())[0]   # on node-0


def _deleting(grace_ended_at: str | None):
    pod = copy.deepcopy(POD)
    if grace_ended_at:
        pod["metadata"]["deletionTimestamp"] = grace_ended_at
    return pod


@pytest.mark.parametrize("ends, node_ready, now, force, lingering", [
    (None, False, at(100), False, False),                     # not being deleted yet
    ("2026-01-01T12:00:00Z", True, at(-1), False, False),    # in its grace period on a ready node
    ("2026-01-01T12:00:00Z", True, at(100), False, True),    # node fine: wait for its kubelet
    ("2026-01-01T12:00:00Z", None, at(100), False, True),    # node unknown: wait
    # A lost node's kubelet can honour no grace period: waiting it out (and 30 s more) held an
    # elastic job's shrink to about 60 s (make chaos, the restart gap). Fencing, not the wait,
    # keeps a trainer still running there from committing, so the pod goes at once.
    ("2026-01-01T12:00:00Z", False, at(-30), True, True),    # node lost, deletion just requested
    ("2026-01-01T12:00:00Z", False, at(29), True, True),     # node lost, grace period over
])
def test_lingering(ends, node_ready, now, force, lingering):
    ready = {} if node_ready is None else {"node-0": NodeReadiness(node_ready)}
    out = stale.lingering([_deleting(ends)], ready, now)
    assert bool(out) == lingering
    if out:
        assert out[0].pod == "tiny-node-0" and out[0].force_delete == force and "node-0" in out[0].message
