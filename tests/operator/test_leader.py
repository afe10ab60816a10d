"""The leader elector (sftjob_operator/leader.py) against the local cluster's real API server.

Short timings (lease 3 s, renew deadline 2 s, retry 0.5 s) keep each test to seconds; the
rules are the same as with the defaults. `on_lost` is recorded instead of ending pytest.
"""
from __future__ import annotations

import threading
import time

import pytest

from sftjob_operator import metrics
from sftjob_operator.leader import Config, LeaderElector, LeaseLock

from tests.fixtures.cluster import wait_for

pytestmark = pytest.mark.cluster
LEASE = 3.0
RENEW = 2.0
RETRY = 0.5


@pytest.fixture
def client(cluster):
    c = cluster.api_client()
    yield c
    c.close()


class Lost:
    """Stands in for os._exit: records when and why the elector gave up."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.reason = ""

    def __call__(self, reason: str) -> None:
        self.at, self.reason = time.monotonic(), reason


def elector(client, ns: str, ident: str, lock: LeaseLock | None = None, **kw) -> tuple[LeaderElector, Lost]:
    lost = Lost()
    cfg = Config(namespace=ns, name="op", identity=ident, lease_duration=LEASE, renew_deadline=RENEW,
                 retry_period=RETRY)
    return LeaderElector(cfg, lock or LeaseLock(ns, "op", client), on_lost=lost, **kw), lost


def lease(cluster, ns: str) -> dict:
    return cluster.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/op")


def acquire_in_thread(e: LeaderElector) -> tuple[threading.Thread, threading.Event, dict]:
    stop, out = threading.Event(), {}

    def run() -> None:
        out["won"] = e.acquire(stop)
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop, out


def test_acquire_creates_the_lease_and_a_second_candidate_waits(cluster, namespace, client):
    a, _ = elector(client, namespace, "a")
    b, _ = elector(client, namespace, "b")
    assert a.acquire() and a.is_leader
    spec = lease(cluster, namespace)["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 3 and spec["leaseTransitions"] == 0
    assert metrics.LEADER._value.get() == 1  # the gauge /metrics exports
    a.start_renewing()
    try:
        t, stop, out = acquire_in_thread(b)
        time.sleep(3 * LEASE)  # three lease durations: a renews, so b never gets it
        assert "won" not in out and b.holder == "a" and not b.is_leader
        stop.set()
        t.join(5)
        assert out["won"] is False
        renewed = lease(cluster, namespace)["spec"]
        assert renewed["holderIdentity"] == "a" and renewed["renewTime"] > spec["renewTime"]
        assert renewed["acquireTime"] == spec["acquireTime"]
    finally:
        a.stop_renewing()


def test_takeover_only_after_the_lease_expires(cluster, namespace, client):
    """A leader that stops renewing (SIGKILL): the standby takes over no sooner than one lease
    duration after it last saw the record change, and not much later."""
    a, _ = elector(client, namespace, "a")
    b, _ = elector(client, namespace, "b")
    assert a.acquire()
    last_write = time.monotonic()          # a is "killed" here: no renewal
    t, _, out = acquire_in_thread(b)
    t.join(LEASE + 5 * RETRY + 5)
    assert out.get("won") is True, "the standby never took over"
    waited = out["at"] - last_write
    assert LEASE <= waited <= LEASE + 3 * RETRY + 1, waited
    spec = lease(cluster, namespace)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


def test_release_on_shutdown_hands_over_at_once(cluster, namespace, client):
    a, _ = elector(client, namespace, "a")
    b, _ = elector(client, namespace, "b")
    assert a.acquire()
    a.start_renewing()
    t, _, out = acquire_in_thread(b)
    time.sleep(LEASE)
    assert "won" not in out
    released = time.monotonic()
    assert a.release() and not a.is_leader
    t.join(3 * RETRY + 5)
    assert out.get("won") is True
    assert out["at"] - released < 2 * RETRY + 0.5, out["at"] - released   # no wait for expiry
    assert lease(cluster, namespace)["spec"]["holderIdentity"] == "b"
    assert a.release() is False  # not the holder any more: leaves b's Lease alone
    assert lease(cluster, namespace)["spec"]["holderIdentity"] == "b"


class RacingLock(LeaseLock):
    """Every candidate reads, then all write at once: the resourceVersion decides."""

    def __init__(self, ns: str, client, barrier: threading.Barrier):
        super().__init__(ns, "op", client)
        self.barrier = barrier

    def get(self, timeout: float):
        got = super().get(timeout)
        self.barrier.wait(10)
        return got


@pytest.mark.parametrize("existing", [False, True], ids=["create-race", "update-race"])
def test_conflicting_candidates_exactly_one_wins(cluster, namespace, client, existing):
    n = 4
    if existing:  # a released Lease: free for anyone at once
        first, _ = elector(client, namespace, "first")
        assert first.acquire() and first.release()
    barrier = threading.Barrier(n)
    cands = [elector(client, namespace, f"c{i}", lock=RacingLock(namespace, client, barrier))[0] for i in range(n)]
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda e=e: results.__setitem__(e.cfg.identity, e.try_acquire_or_renew()))
               for e in cands]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    winners = [k for k, v in results.items() if v]
    assert len(results) == n and len(winners) == 1, results
    assert lease(cluster, namespace)["spec"]["holderIdentity"] == winners[0]


class CuttableLock(LeaseLock):
    """The leader's connection to the API server, which the test can cut."""

    cut = False

    def _check(self) -> None:
        if self.cut:
            time.sleep(0.2)
            raise ConnectionError("network unreachable (test)")

    def get(self, timeout):
        self._check()
        return super().get(timeout)

    def update(self, lease, spec, timeout):
        self._check()
        return super().update(lease, spec, timeout)


def test_leader_cut_off_stops_before_the_standby_takes_over(cluster, namespace, client):
    """Network loss: the leader cannot renew, gives up after the renew deadline, and that is
    before the standby may take over (lease duration after its last observation)."""
    lock = CuttableLock(namespace, "op", client)
    a, a_lost = elector(client, namespace, "a", lock=lock)
    b, _ = elector(client, namespace, "b")
    assert a.acquire()
    a.start_renewing()
    t, _, out = acquire_in_thread(b)
    time.sleep(2 * RETRY)
    lock.cut = True
    cut_at = time.monotonic()
    t.join(LEASE + RENEW + 5)
    assert out.get("won") is True
    assert a_lost.at is not None and "renew deadline" in a_lost.reason, a_lost.reason
    assert a_lost.at - cut_at <= RENEW + 0.5
    # The safety margin: the old leader stopped well before the new one started.
    assert out["at"] - a_lost.at >= (LEASE - RENEW) - RETRY - 0.5, (out["at"] - a_lost.at)
    a.stop_renewing()


def test_leader_whose_lease_was_taken_stops_at_once(cluster, namespace, client):
    """Someone else's name in the Lease (an operator's mistake, a clock gone wild): the
    leader gives up at its next renewal instead of acting beside it."""
    a, a_lost = elector(client, namespace, "a")
    assert a.acquire()
    a.start_renewing()
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/op"
    cluster.kube.merge_patch(path, {"spec": {"holderIdentity": "intruder"}})
    wait_for(lambda: a_lost.at, 2 * RETRY + 2, interval=0.05, what="the leader to give up")
    assert "intruder" in a_lost.reason and not a.is_leader
    a.stop_renewing()
    assert a.release() is False
    assert lease(cluster, namespace)["spec"]["holderIdentity"] == "intruder"

