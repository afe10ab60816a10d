"""Two operator processes with leader election against the local cluster (acceptance:
"a test kills the leader mid-job and the job still succeeds with exactly one gang per
attempt").

Both run `sftjob-operator --leader-elect` with the default timings (lease 15 s, renew
deadline 10 s, retry 2 s) and a Lease in the test's namespace. The standby must not act while
the leader lives (its own metrics: no reconcile, no pod); after SIGKILL of the leader it takes
over within the lease duration, and the job succeeds with one pod per rank per attempt and no
restart counted for the handover.

SFTJOB_LEADER_TEST_NO_ELECTION=1 runs the same test with `--no-leader-elect` (both replicas
act), to show that it fails without the feature.
"""
from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections import defaultdict

import pytest

from hack.localcluster.operator_proc import OperatorProcess
from tests.chart.test_install import other_operators
from tests.fixtures.cluster import wait_for

from .cluster_kit import RESUMABLE, Recorder, apply, checkpointed, diagnose, example, phase_is, wait_job

pytestmark = pytest.mark.cluster
LEASE_S, RENEW_S, RETRY_S = 15.0, 10.0, 2.0
ELECTION = os.environ.get("SFTJOB_LEADER_TEST_NO_ELECTION") != "1"


class ElectedOperator(OperatorProcess):
    """OperatorProcess with leader election on a Lease in `lease_ns`, scoped to `watch_ns`."""

    def __init__(self, env, log_path, pod_name: str, lease_ns: str, watch_ns: str):
        election = (["--leader-elect", "--leader-election-namespace", lease_ns,
                     "--leader-election-name", "sftjob-operator-ha"] if ELECTION else ["--no-leader-elect"])
        super().__init__({**env, "POD_NAME": pod_name}, log_path, namespaces=[watch_ns], extra_args=election)
        self.lease_ns, self.watch_ns = lease_ns, watch_ns

    def healthz(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (0 when it has none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def is_leader(self) -> bool:
        return self.metric("sftjob_operator_leader") == 1.0


def holder(cluster, ns: str) -> str:
    return cluster.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/sftjob-operator-ha")[
        "spec"].get("holderIdentity") or ""


@pytest.fixture
def pair(cluster, crd, example_ns, tmp_path):
    ops = [ElectedOperator(cluster.env, tmp_path / f"op-{c}.log", f"op-{c}", example_ns, example_ns) for c in "ab"]
    ops[0].start()
    if ELECTION:
        wait_for(ops[0].is_leader, 30, what="op-a to lead")
    ops[1].start()
    yield ops
    for op in ops:
        op.stop()
    print("operator logs:", *(op.log_path for op in ops))


@pytest.mark.timeout(1200)
def test_leader_killed_mid_job_standby_takes_over(cluster, example_ns, pair):
    ns, name = example_ns, "ha"
    a, b = pair
    # Long enough that the job is still running when the standby takes over.
    apply(cluster, ns, example(name, **{**RESUMABLE, "training.totalTrainingSteps": 100}))
    rec = Recorder(cluster, ns, name)
    rec.start()
    try:
        wait_job(cluster, ns, name, a, checkpointed(5), what="a committed checkpoint")
        # The standby has done nothing while the leader lives.
        assert b.metric("sftjob_operator_leader") == 0, "two leaders"
        if ELECTION:
            assert '"leader": false' in b.healthz()  # the standby's own /healthz: live, holds nothing
        assert b.metric("sftjob_operator_reconciles_total") == 0, "the standby reconciled"
        assert b.metric("sftjob_operator_pods_created_total") == 0, "the standby created pods"
        assert a.metric("sftjob_operator_reconciles_total") > 0
        if not other_operators():  # a cluster-wide operator of another test run may create them first
            assert a.metric("sftjob_operator_pods_created_total") == 2
        assert holder(cluster, ns).startswith("op-a_")

        a.kill()  # SIGKILL mid-job: no release, the Lease must expire
        killed = time.monotonic()
        took = wait_for(lambda: b.is_leader() and time.monotonic(), LEASE_S + 20, interval=0.1,
                        what="the standby to take over")
        first = wait_for(lambda: b.metric("sftjob_operator_reconciles_total") > 0 and time.monotonic(), 30,
                         interval=0.1, what="the new leader's first reconcile")
        took_wall = time.time() - (time.monotonic() - took)
        print(f"SIGKILL -> standby leads {took - killed:.1f}s, -> first reconcile {first - killed:.1f}s")
        assert took - killed >= LEASE_S - RETRY_S - 1, "took over before the Lease could have expired"
        assert first - killed <= LEASE_S + RETRY_S + 5, f"takeover took {first - killed:.1f}s"
        assert holder(cluster, ns).startswith("op-b_")
        # The standby's /healthz gave way to kopf's on the same port (its probe: the scheduler).
        wait_for(lambda: "scheduler" in b.healthz(), 30, what="kopf's /healthz on the new leader")

        a.start()  # restarted by its Deployment: now a standby
        time.sleep(2 * RETRY_S)
        assert not a.is_leader() and a.metric("sftjob_operator_reconciles_total") == 0
        job = wait_job(cluster, ns, name, b, phase_is("Succeeded", "Failed"), timeout=900, what="success")
    finally:
        rec.stop()
    assert job["status"]["phase"] == "Succeeded", diagnose(cluster, ns, name, b)
    assert job["status"]["progress"]["step"] == 100
    after = [st for t, st, _ in rec.samples if t >= took_wall]
    assert any(st.get("phase") == "Running" for st in after), "the job ended before the takeover"
    rec.check_invariants(nodes=2)
    # Exactly one pod per rank per attempt (no pod created twice), one attempt, and the
    # handover counted as no restart.
    uids: dict[tuple[str, str], set[str]] = defaultdict(set)
    for _, _, pods in rec.samples:
        for p in pods:
            labels = p["metadata"]["labels"]
            uids[(labels["sftjob.io/attempt"], labels["sftjob.io/rank"])].add(p["metadata"]["uid"])
    assert {k: len(v) for k, v in uids.items()} == {("0", "0"): 1, ("0", "1"): 1}, dict(uids)
    assert job["status"].get("attempt", 0) == 0
    restarts = job["status"].get("restarts", {})
    assert all(restarts.get(k, 0) == 0 for k in ("failures", "preemptions", "total")), restarts
    assert b.metric("sftjob_operator_pods_created_total") == 0, "the new leader re-created a live gang's pods"
    assert b.metric("sftjob_operator_gang_restarts_total") == 0
    assert a.metric("sftjob_operator_reconciles_total") == 0, "the restarted standby acted"


@pytest.mark.skipif(not ELECTION, reason="leader election off")
def test_lease_taken_away_exits_and_sigterm_releases(cluster, crd, namespace, tmp_path):
    """Process level: a leader whose Lease another holder took exits at once with status 75;
    a leader stopped with SIGTERM hands the Lease back (empty holder) for an instant takeover."""
    op = ElectedOperator(cluster.env, tmp_path / "op.log", "op-solo", namespace, namespace)
    op.start()
    try:
        wait_for(op.is_leader, 30, what="the only candidate to lead")
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/sftjob-operator-ha"
        cluster.kube.merge_patch(path, {"spec": {"holderIdentity": "someone-else"}})
        t0 = time.monotonic()
        rc = op.proc.wait(2 * RETRY_S + 10)
        assert rc == 75, op.tail()
        print(f"exit {rc} {time.monotonic() - t0:.1f}s after the Lease was taken")
        assert "lost the Lease" in op.tail()
        cluster.kube.merge_patch(path, {"spec": {"holderIdentity": ""}})  # free again
        op.start()
        wait_for(op.is_leader, 30, what="the restarted candidate to lead")
        op.proc.send_signal(signal.SIGTERM)
        assert op.proc.wait(30) == 0, op.tail()
        spec = cluster.kube.get(path)["spec"]
        assert spec.get("holderIdentity", "") == "" and spec["leaseDurationSeconds"] == 1, spec
    finally:
        op.stop()
