"""Suspend policy, table-driven: spec.suspend and the phase decide one step."""
from __future__ import annotations

import pytest
from .op_testkit import apply, at, job_body, pods_for

from sftjob_operator import reconcile, suspend
from sftjob_operator.suspend import Step

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("phase, wanted, step", [
    ("Pending", False, Step.NONE),
    ("Running", False, Step.NONE),
    ("Pending", True, Step.SUSPEND),
    ("Running", True, Step.SUSPEND),
    ("Restarting", True, Step.SUSPEND),
    ("Suspended", True, Step.SUSPENDED),
    ("Suspended", False, Step.RESUME),
])
def test_step(phase, wanted, step):
    assert suspend.step(phase, wanted) is step


def test_suspending_tears_the_gang_down_without_counting_a_restart():
    body = job_body()
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body)
    body = apply(body, reconcile.plan(body, pods, at(5)))   # running since 5s
    body["spec"]["suspend"] = True
    plan = reconcile.plan(body, pods, at(10))
    st = plan.new_status
    assert (st.phase, st.attempt, st.start_time, st.restarts.total) == ("Suspended", 1, None, 0)
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"] and plan.restart_cause is None
    body = apply(body, plan)
    body["spec"]["suspend"] = False
    plan = reconcile.plan(body, [], at(20))
    assert plan.new_status.phase == "Pending" and len(plan.launch) == 2
    assert {p["metadata"]["labels"]["sftjob.io/attempt"] for p in plan.launch} == {"1"}
