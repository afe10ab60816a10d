"""Leader election on a `coordination.k8s.io/v1` Lease, so that several replicas can run and
exactly one acts.

How it is used (cli.main): a replica blocks in `LeaderElector.acquire()` until it holds the
Lease (a standby: it serves /healthz and /metrics but watches nothing and writes nothing);
then it starts kopf and `start_renewing()` keeps the Lease in background threads. A leader
that has not renewed for `renew_deadline` seconds ends its process at once
(`os._exit(EXIT_LEASE_LOST)`), without cleanup, so that it never acts after another replica
may have taken over; its Deployment restarts it as a standby. A clean shutdown releases the
Lease (empty holder), so that a standby takes over on its next poll instead of waiting for
the Lease to expire.

Why two replicas can never both act:
- Every write is conditional on the resourceVersion just read (optimistic concurrency): of
  two candidates that saw the same record, one write wins and the other gets 409.
- A candidate takes a held Lease only after the record stayed unchanged for
  `leaseDurationSeconds` measured on its own monotonic clock from when *it* first saw that
  record (as client-go does), so no wall clocks are compared between machines.
- The leader stamps each renewal's start time before sending it and exits once
  `renew_deadline` (< lease duration) has passed since the last successful one. The record a
  standby observes was written after that stamp, so the standby waits at least
  `lease_duration` from a point later than the leader's stamp: the leader is gone with
  `lease_duration - renew_deadline` seconds to spare (5 s by default; clock *rates* only
  need to agree to a few percent).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, UTC
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from collections.abc import Callable

import kubernetes
from kubernetes.client.exceptions import ApiException

from .kube import api_client
from .metrics import LEADER, TRANSITIONS

log = logging.getLogger("sftjob_operator.leader")

# The process exit status of a leader that lost its Lease (no other path of the operator
# exits with it), so that logs and `kubectl describe pod` tell why it restarted.
EXIT_LEASE_LOST = 75
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"



@dataclass
class Config:
    namespace: str
    name: str = "sftjob-operator"
    identity: str = ""
    lease_duration: float = 15.0    # a standby takes over after the record is this old
    renew_deadline: float = 10.0    # a leader that could not renew for this long exits
    retry_period: float = 2.0       # poll (standby) and renew (leader) interval

    def __post_init__(self) -> None:
        if not self.identity:
            self.identity = default_identity()
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration "
                             f"(got {self.retry_period}, {self.renew_deadline}, {self.lease_duration})")


def default_identity() -> str:
    """The pod name (downward API) or host name, plus a random suffix: a restarted container
    of the same pod is a new candidate, never mistaken for the old leader."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str | None:
    """POD_NAMESPACE (downward API), else the in-cluster ServiceAccount's namespace."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def in_cluster() -> bool:
    """Running in a pod with a ServiceAccount token (what load_incluster_config needs)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(SA_NAMESPACE_FILE)


def _micro_time(dt: datetime) -> str:
    # MicroTime wants exactly six fractional digits (isoformat() drops them at .000000).
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _exit_lost(reason: str) -> None:
    log.critical("leader election: lost the Lease (%s); exiting at once so that this replica never acts "
                 "beside the new leader (exit %d)", reason, EXIT_LEASE_LOST)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway: flushing is best effort
            pass
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


class LeaseLock:
    """The three Lease calls, as plain dicts; each raises ApiException (or a transport error)."""

    def __init__(self, namespace: str, name: str, client: kubernetes.client.ApiClient | None = None):
        self.namespace, self.name = namespace, name
        self.api = kubernetes.client.CoordinationV1Api(client or api_client(pool=2))

    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        lease: dict[str, Any] = json.loads(resp.data)
        return lease

    def get(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self._json(self.api.read_namespaced_lease(self.name, self.namespace, _preload_content=False,
                                                             _request_timeout=timeout))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create(self, spec: dict[str, Any], timeout: float, dry_run: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                "metadata": {"name": self.name, "namespace": self.namespace,
                                             "labels": {"app.kubernetes.io/component": "operator",
                                                        "app.kubernetes.io/part-of": "sftjob"}},
                                "spec": spec}
        kw: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
        return self._json(self.api.create_namespaced_lease(  # the client serializes a dict body as well
            self.namespace, body, _preload_content=False,  # type: ignore[arg-type]
            _request_timeout=timeout, **kw))

    def update(self, lease: dict[str, Any], spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Replace the spec, only if the Lease is still at the resourceVersion read (else 409)."""
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": lease["metadata"], "spec": spec}
        return self._json(self.api.replace_namespaced_lease(  # the client serializes a dict body as well
            self.name, self.namespace, body, _preload_content=False,  # type: ignore[arg-type]
            _request_timeout=timeout))


class LeaderElector:
    def __init__(self, cfg: Config, lock: LeaseLock | None = None,
                 on_lost: Callable[[str], None] = _exit_lost, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.lock = lock or LeaseLock(cfg.namespace, cfg.name)
        self.on_lost = on_lost
        self.clock = clock
        self.is_leader = False
        self.holder: str | None = None          # holder in the last record read
        self.renewed_at = 0.0                   # clock() at the start of the last successful write
        self._lease: dict[str, Any] | None = None
        self._observed_rv: str | None = None
        self._observed_at = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lost = False
        self._mutex = threading.Lock()          # one Lease write at a time (renew loop vs. release)
        self._state = threading.Lock()          # _lost and _stop, never held across a request
        LEADER.set(0)

    # -- one attempt ------------------------------------------------------------------------
    def try_acquire_or_renew(self, timeout: float | None = None) -> bool:
        """Read the Lease and, if it is free, expired or ours, write ourselves in (conditional
        on the resourceVersion read). True: we hold it now."""
        timeout = timeout or max(1.0, self.cfg.renew_deadline / 2)
        me = self.cfg.identity
        started = self.clock()
        now = _micro_time(datetime.now(UTC))
        try:
            lease = self.lock.get(timeout)
            if lease is None and self.is_leader:
                self.holder = ""   # deleted under us: a standby may be creating it right now
                return False
            if lease is None:
                spec: dict[str, Any] = {"holderIdentity": me,
                                        "leaseDurationSeconds": int(round(self.cfg.lease_duration)),
                                        "acquireTime": now, "renewTime": now, "leaseTransitions": 0}
                lease = self.lock.create(spec, timeout)
                self._won(lease, started)
                return True
            spec = lease.get("spec") or {}
            rv = lease["metadata"]["resourceVersion"]
            if rv != self._observed_rv:
                self._observed_rv, self._observed_at = rv, started
            holder = spec.get("holderIdentity") or ""
            self.holder = holder
            if self.is_leader and holder != me:
                return False       # taken or cleared under us: the renew loop ends this process
            if holder and holder != me:
                duration = spec.get("leaseDurationSeconds") or self.cfg.lease_duration
                if started - self._observed_at < duration:
                    return False
                log.info("leader election: the Lease of %s has not been renewed for %.0fs; taking over",
                         holder, started - self._observed_at)
            elif holder == me and not self.is_leader:
                # Our own identity from before (cannot happen with a random suffix, but a
                # record we did not write this run is not proof we hold it): treat as foreign.
                duration = spec.get("leaseDurationSeconds") or self.cfg.lease_duration
                if started - self._observed_at < duration:
                    return False
            new: dict[str, Any] = {"holderIdentity": me, "leaseDurationSeconds": int(round(self.cfg.lease_duration)),
                   "renewTime": now}
            if holder == me:
                new["acquireTime"] = spec.get("acquireTime") or now
                new["leaseTransitions"] = spec.get("leaseTransitions") or 0
            else:
                new["acquireTime"] = now
                new["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + 1
            lease = self.lock.update(lease, new, timeout)
            self._won(lease, started)
            return True
        except ApiException as err:
            if err.status == 409:
                log.debug("leader election: conflict (another candidate wrote first)")
            else:
                log.warning("leader election: Lease %s/%s: %s %s", self.cfg.namespace, self.cfg.name,
                            err.status, err.reason)
            return False
        except Exception as err:  # noqa: BLE001 - a transport error is one failed attempt
            log.warning("leader election: Lease %s/%s unreachable: %s", self.cfg.namespace, self.cfg.name, err)
            return False

    def _won(self, lease: dict[str, Any], started: float) -> None:
        self._lease = lease
        self._observed_rv, self._observed_at = lease["metadata"]["resourceVersion"], started
        self.holder = self.cfg.identity
        self.renewed_at = started

    # -- standby ----------------------------------------------------------------------------
    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica holds the Lease (True) or `stop` is set (False)."""
        stop = stop or threading.Event()
        log.info("leader election: candidate %s for Lease %s/%s (duration %ss, renew deadline %ss, retry %ss)",
                 self.cfg.identity, self.cfg.namespace, self.cfg.name, self.cfg.lease_duration,
                 self.cfg.renew_deadline, self.cfg.retry_period)
        last_holder = None
        while not stop.is_set():
            if self.try_acquire_or_renew():
                self.is_leader = True
                LEADER.set(1)
                TRANSITIONS.inc()
                log.info("leader election: %s is now the leader", self.cfg.identity)
                return True
            if self.holder != last_holder:
                last_holder = self.holder
                log.info("leader election: standing by; the leader is %s", self.holder or "nobody")
            stop.wait(self.cfg.retry_period)
        return False

    # -- leader -----------------------------------------------------------------------------
    def start_renewing(self) -> None:
        assert self.is_leader, "acquire() first"
        self._stop.clear()
        self._threads = [threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True),
                         threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True)]
        for t in self._threads:
            t.start()

    def _lose(self, reason: str) -> None:
        with self._state:
            if self._lost or self._stop.is_set():
                return
            self._lost = True
            self.is_leader = False
            LEADER.set(0)
        self.on_lost(reason)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.cfg.retry_period):
            with self._mutex:
                if self._stop.is_set():
                    return
                remaining = self.renewed_at + self.cfg.renew_deadline - self.clock()
                ok = self.try_acquire_or_renew(timeout=max(0.5, min(remaining, self.cfg.renew_deadline / 2)))
                holder = self.holder
            if not ok and holder != self.cfg.identity:
                self._lose(f"{holder} holds it now" if holder else "the Lease was cleared or deleted")
                return

    def _watchdog(self) -> None:
        tick = min(0.25, self.cfg.retry_period / 4)
        while not self._stop.wait(tick):
            age = self.clock() - self.renewed_at
            if age > self.cfg.renew_deadline:
                self._lose(f"not renewed for {age:.1f}s, over the {self.cfg.renew_deadline:g}s renew deadline")
                return

    def stop_renewing(self) -> None:
        with self._state:
            self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self.cfg.renew_deadline)
        self._threads = []

    def release(self) -> bool:
        """Stop renewing and hand the Lease back (empty holder, 1 s duration) if we still hold
        it, so that a standby takes over at its next poll. Call only once this replica has
        stopped acting."""
        self.stop_renewing()
        if not self.is_leader:
            return False
        self.is_leader = False
        LEADER.set(0)
        try:
            lease = self.lock.get(self.cfg.renew_deadline / 2)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.cfg.identity:
                return False
            now = _micro_time(datetime.now(UTC))
            spec = {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                    "leaseTransitions": (lease.get("spec") or {}).get("leaseTransitions") or 0}
            self.lock.update(lease, spec, self.cfg.renew_deadline / 2)
            log.info("leader election: released the Lease %s/%s", self.cfg.namespace, self.cfg.name)
            return True
        except Exception as err:  # noqa: BLE001 - then the standby waits for expiry
            log.warning("leader election: could not release the Lease (%s); a standby takes over when it expires",
                        err)
            return False


class StandbyHealth:
    """/healthz (200) on the liveness port while standing by, so that the kubelet neither
    kills nor un-readies a standby (kopf's own endpoint exists only once kopf runs, and a
    not-Ready standby would count as disrupted in the PodDisruptionBudget). Stopped just
    before kopf binds the same port."""

    def __init__(self, port: int, elector: LeaderElector, host: str = "0.0.0.0"):
        elector_ = elector

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/healthz":
                    self.send_error(404)
                    return
                body = json.dumps({"leader": elector_.is_leader, "identity": elector_.cfg.identity,
                                   "holder": elector_.holder}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="standby-health", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
