"""kopf wiring: every trigger leads to the same idempotent `reconcile_job`.

Triggers: SFTJob create/resume/spec update (kopf handlers, so kopf's error taxonomy
applies), pod events (enqueue the owning job), and a requeue scheduler that plays the role
of a timer. kopf timers and daemons would put a finalizer on every SFTJob (kopf#833),
which blocks deletion while the operator is down; the scheduler needs none, and it fires
each job exactly when the job asked to be looked at again (a TTL expiry, the end of a
restart back-off), plus a periodic resync that catches anything missed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import Any, cast

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from sftjob_contract.metrics import METRICS_PATH

from . import api, builders, children, metrics, progress, reconcile, rejections, status
from . import conditions as c
from .failure_policy import NodeLease, NodeReadiness
from .kube import Conflict, Kube
from .phases import TERMINAL, PodPhase
from .plan import Plan
from .settings import Settings

log = logging.getLogger("sftjob_operator")

RESYNC_S = 60.0
TICK_S = 0.2
ERROR_RETRY_S = 5.0
MAX_PARALLEL = 16
# Threads for the (synchronous) Kubernetes client calls of all passes together; asyncio's
# default pool has cpu+4 (6 on 2 cores), which held 16 passes and kopf's handlers back.
API_THREADS = 32
Key = tuple[str, str]


@dataclass
class Runtime:
    """Per-process state. Nothing here must survive a restart: the truth is in the API."""

    kube: Kube
    namespaces: list[str] | None
    session: aiohttp.ClientSession | None = None
    scraper: progress.Scraper | None = None
    due: dict[Key, float] = field(default_factory=dict)
    urgent: set[Key] = field(default_factory=set)   # due because something happened, not a timer
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    phases: metrics.PhaseBook = field(default_factory=metrics.PhaseBook)
    last_tick: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    running: set[Key] = field(default_factory=set)
    # When this process began watching (kopf starts it only after the leader lease is won):
    # the progress watchdog counts no time before it (deadlines.progress_left).
    observing_since: datetime = field(default_factory=lambda: datetime.now(UTC))
    settings: Settings = field(default_factory=Settings)

    def enqueue(self, key: Key, after: float = 0.0, urgent: bool = False) -> None:
        """Reconcile `key` in `after` seconds. Urgent ones (a pod changed, progress moved)
        run before the timers that are due, so that a new job or a lost pod never waits
        behind a thousand periodic passes."""
        when = time.monotonic() + after
        if key not in self.due or when < self.due[key]:
            self.due[key] = when
        if urgent:
            self.urgent.add(key)

    def next_due(self, now: float, slots: int) -> list[Key]:
        """Up to `slots` due keys not running: urgent first, then the longest overdue."""
        ready = [k for k, when in self.due.items() if when <= now and k not in self.running]
        ready.sort(key=lambda k: (k not in self.urgent, self.due[k]))
        picked = ready[:max(0, slots)]
        for k in picked:
            del self.due[k]
            self.urgent.discard(k)
        return picked

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())


def _rt(memo: Any) -> Runtime:
    rt: Runtime = memo["sftjob"]
    return rt


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ours = memo.get("settings")   # built by cli.main, handed over through kopf.run(memo=...)
    if not isinstance(ours, Settings):
        raise kopf.PermanentError("no operator settings: start the operator with `sftjob-operator` (cli.main)")
    # Watches that silently stop are kopf's classic failure (kopf#585): bound both sides.
    settings.watching.server_timeout = ours.watch_server_timeout
    settings.watching.client_timeout = ours.watch_server_timeout + 30
    settings.watching.connect_timeout = 30
    # A namespace-scoped install has no right to list namespaces; with only exact names
    # kopf needs no scanning, and skipping it starts the watches at once instead of after
    # about a minute of retried 403s.
    if ours.exact_namespaces:
        settings.scanning.disabled = True
    settings.peering.standalone = ours.peering_name is None
    if ours.peering_name is not None:
        settings.peering.name = ours.peering_name
        settings.peering.clusterwide = not ours.namespaces
    # kopf's own bookkeeping in annotations, never in status (which we own and write whole).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.sftjob.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.sftjob.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="k8s-api"))
    rt = Runtime(kube=Kube(), namespaces=list(ours.namespaces) if ours.namespaces else None, settings=ours)
    rt.session = aiohttp.ClientSession()
    # Progress is read in the background: a reconcile never waits on a trainer's endpoint,
    # so one unreachable pod cannot delay another job's reconcile.
    # The scraper hands back the keys it was given: this runtime's (namespace, name) Keys.
    rt.scraper = progress.Scraper(rt.session, on_change=lambda key: rt.enqueue(cast(Key, key), urgent=True))
    rt.task = asyncio.create_task(_scheduler(rt), name="sftjob-scheduler")
    memo["sftjob"] = rt


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    rt = memo.get("sftjob")
    if rt is None:
        return
    if rt.task:
        rt.task.cancel()
    if rt.scraper:
        rt.scraper.close()
    if rt.session:
        await rt.session.close()


@kopf.on.probe(id="scheduler")
def scheduler_alive(memo: kopf.Memo, **_: Any) -> float:
    """Liveness: the requeue scheduler ticked recently (a stuck loop fails the probe)."""
    age = time.monotonic() - _rt(memo).last_tick
    if age > 60:
        raise kopf.PermanentError(f"scheduler has not ticked for {age:.0f}s")
    return round(age, 3)


@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")  # type: ignore[arg-type]  # kopf: namespace: str | None; ours are namespaced
async def on_job(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    await reconcile_job(_rt(memo), namespace, name, from_handler=True)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)  # type: ignore[arg-type]  # kopf: namespace: str | None; ours are namespaced
def on_job_event(event: kopf.RawEvent, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    if event.get("type") == "DELETED":
        rt = _rt(memo)
        rt.phases.set((namespace, name), None)
        rt.due.pop((namespace, name), None)
        rt.urgent.discard((namespace, name))
        rt.locks.pop((namespace, name), None)
        if rt.scraper:
            rt.scraper.forget((namespace, name))


@kopf.on.event("", "v1", "pods", labels={builders.LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # kopf: namespace: str | None; ours are namespaced
def on_pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    _rt(memo).enqueue((namespace, labels[builders.LABEL_JOB]), urgent=True)


async def _scheduler(rt: Runtime) -> None:
    """Run due reconciles, MAX_PARALLEL at a time (urgent first), and resync all jobs now
    and then. A pass starts only when a slot is free, so the order is decided when it
    starts, not when it became due."""
    last_resync = 0.0

    async def one(key: Key) -> None:
        try:
            await reconcile_job(rt, *key)
        except Exception as err:  # noqa: BLE001 - a failing job must not stop the others
            log.warning("reconcile %s/%s failed: %s", *key, err)
            rt.enqueue(key, ERROR_RETRY_S)
        finally:
            rt.running.discard(key)

    while True:
        rt.last_tick = now = time.monotonic()
        for key in rt.next_due(now, MAX_PARALLEL - len(rt.running)):
            rt.running.add(key)
            asyncio.create_task(one(key))
        if now - last_resync >= RESYNC_S:
            last_resync = now
            try:
                await resync(rt)
            except Exception as err:  # noqa: BLE001 - the next resync tries again
                log.warning("resync failed: %s", err)
        await asyncio.sleep(TICK_S)


async def resync(rt: Runtime) -> None:
    """Queue a pass for every job (what a missed event left behind)."""
    for job in await rt.kube.list_jobs(rt.namespaces):
        meta = job["metadata"]
        rt.enqueue((meta["namespace"], meta["name"]))
        # One job's unreadable status must not keep the jobs after it from their pass.
        with contextlib.suppress(ValidationError):
            rt.phases.set((meta["namespace"], meta["name"]), status.parse(job.get("status")).phase)


def _phase(pod: dict[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("phase")


def _nodes(pods: list[dict[str, Any]], *phases: str) -> set[str]:
    return {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName") and _phase(p) in phases}


def _resizable(body: dict[str, Any]) -> bool:
    """Whether the job may change size (elastic, or running at another size than it wants):
    only then are the cluster's Nodes read for it."""
    res = (body.get("spec") or {}).get("resources") or {}
    nodes, running = res.get("nodes", 1), (body.get("status") or {}).get("nodes")
    return res.get("minNodes", nodes) < nodes or running not in (None, nodes)


async def _observe(rt: Runtime, key: Key, body: dict[str, Any], pods: list[dict[str, Any]]
                   ) -> tuple[dict[str, NodeReadiness], dict[str, NodeLease], dict[str, Any] | None]:
    attempt = status.parse(body.get("status")).attempt
    gang = [p for p in pods if builders.pod_attempt(p) == attempt]
    nodes = _nodes(pods, PodPhase.PENDING, PodPhase.RUNNING)
    node_ready = await rt.kube.node_ready(nodes) if nodes else {}
    # A rank of the gang failed beside running ones: their nodes' heartbeats tell a failure
    # from the echo of a dead machine (failure_policy.settle_generic_failure). Read only then.
    running_nodes = _nodes(gang, PodPhase.RUNNING)
    failed = any(_phase(p) == PodPhase.FAILED for p in gang)
    leases = await rt.kube.node_leases(running_nodes) if failed and running_nodes else {}
    scraped = None
    rank0 = next((p for p in gang if p["metadata"].get("labels", {}).get(builders.LABEL_RANK) == "0"), None)
    running = rank0 and _phase(rank0) == PodPhase.RUNNING and rank0["status"].get("podIP")
    if rt.scraper is not None and running and rank0 is not None:
        url = f"http://{rank0['status']['podIP']}:{builders.METRICS_PORT}{METRICS_PATH}"
        scraped = rt.scraper.want(key, rank0["metadata"]["uid"], url)
    elif rt.scraper is not None:
        rt.scraper.forget(key)
    return node_ready, leases, scraped


async def reconcile_job(rt: Runtime, namespace: str, name: str, from_handler: bool = False) -> None:
    """One reconcile pass for one job: read, decide (pure), write status, act."""
    key = (namespace, name)
    async with rt.lock(key):
        started = time.monotonic()
        try:
            plan = await _pass(rt, key)
        except Conflict:
            metrics.RECONCILES.labels(result="conflict").inc()
            rt.enqueue(key, 0.2)
            return
        except ValidationError as err:
            # A status this version cannot read (a value of the wrong type): say so on the
            # job and look again at the resync pace; the other jobs go on (never raised).
            metrics.RECONCILE_ERRORS.labels(kind="status").inc()
            await _report_unreadable_status(rt, key, err)
            rt.enqueue(key, RESYNC_S)
            return
        except ApiException as err:
            if err.status == 404 and await rt.kube.get_job(namespace, name) is None:
                # The job was deleted during the pass (its status write found nothing): done.
                rt.phases.set(key, None)
                return
            metrics.RECONCILE_ERRORS.labels(kind=f"api{err.status}").inc()
            if from_handler:
                raise kopf.TemporaryError(f"API error {err.status}: {err.reason}", delay=ERROR_RETRY_S) from None
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        metrics.RECONCILES.labels(result="ok").inc()
    if plan is not None and plan.invalid and from_handler:
        raise kopf.PermanentError(plan.invalid)


async def _report_unreadable_status(rt: Runtime, key: Key, err: ValidationError) -> None:
    fields = "; ".join(f"status.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5])
    message = (f"this operator cannot read the job's status ({fields}); the job is not reconciled until "
               "it is fixed (run the operator version that wrote it, or correct the status subresource)")
    log.warning("%s/%s: %s", *key, message)
    body = await rt.kube.get_job(*key)
    if body is not None:
        try:
            await rt.kube.post_event(body, "Warning", c.REASON_INVALID_STATUS, message)
        except ApiException as api_err:  # best effort, as for every event
            log.info("event for %s/%s not posted: %s", *key, api_err.reason)


async def _pass(rt: Runtime, key: Key) -> Plan | None:
    namespace, name = key
    body = await rt.kube.get_job(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        rt.phases.set(key, None)
        return None
    pods = await rt.kube.list_pods(namespace, name)
    node_ready, leases, scraped = await _observe(rt, key, body, pods)
    cluster_nodes = await rt.kube.list_nodes() if _resizable(body) else None
    plan = reconcile.plan(body, pods, datetime.now(UTC), node_ready, scraped, node_leases=leases,
                          observing_since=rt.observing_since, cluster_nodes=cluster_nodes)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    rejection = await _apply(rt, key, body, plan, uids)
    if plan.checkpoint_hold_s is not None and rt.scraper is not None and rt.session is not None:  # a planned stop
        if failed := await progress.ask_checkpoint(rt.session, rt.scraper.targets.get(key), plan.checkpoint_hold_s):
            await rt.kube.merge_status(namespace, name, {"checkpointRequest": {"failed": failed}})
            rt.enqueue(key, 0.5)
    if rejection is not None:
        # The API server refused a pod: decide again with that knowledge (fail naming the
        # field, or wait for quota) from the status just written.
        body = await rt.kube.get_job(namespace, name)
        if body is None:
            return plan
        pods = await rt.kube.list_pods(namespace, name)
        plan = reconcile.plan(body, pods, datetime.now(UTC), node_ready, None, rejection, leases,
                              rt.observing_since, cluster_nodes)
        await _apply(rt, key, body, plan, {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods})
    return plan


async def _apply(rt: Runtime, key: Key, body: dict[str, Any], plan: Plan,
                 uids: dict[str, str | None]) -> rejections.Rejection | None:
    """Carry out one plan: status first, then deletions (each of the pod the plan saw:
    `uids` by name), creations, events. Returns the API server's refusal of a pod, when
    there was one (nothing after the launch is done)."""
    namespace, name = key
    new = plan.new_status
    if new is not None:
        before = status.parse(body.get("status"))
        # State first, then act on it.
        body = await rt.kube.patch_status(body, status.merge_patch(body.get("status"), new))
        if (before.phase, before.attempt) != (new.phase, new.attempt):
            log.info("%s/%s: phase %s, attempt %s, restarts %s", namespace, name, new.phase, new.attempt,
                     new.restarts)
    if plan.delete_pods:
        log.info("%s/%s: deleting pods %s", namespace, name, plan.delete_pods)
    await asyncio.gather(*(rt.kube.delete_pod(namespace, p, uid=uids.get(p)) for p in plan.delete_pods))
    if plan.force_delete_pods:
        log.warning("%s/%s: force-deleting pods on lost nodes %s", namespace, name, plan.force_delete_pods)
    await asyncio.gather(*(rt.kube.delete_pod(namespace, p, grace_period_seconds=0, uid=uids.get(p))
                           for p in plan.force_delete_pods))
    if plan.launch:
        job = builders.JobRef.from_body(body)
        spec = builders.parse_spec(body["spec"])
        policy = (builders.build_network_policy(job, list(rt.settings.trainer_metrics_from))
                  if rt.settings.job_network_policy else None)
        refused, wait = await children.ensure(rt.kube, job, spec, policy)
        if refused is not None:
            log.warning("%s/%s: %s", namespace, name, refused.message)
            return refused
        if wait:
            rt.enqueue(key, 1.0)
            return None
        log.info("%s/%s: creating pods %s", namespace, name, [p["metadata"]["name"] for p in plan.launch])
        created = await asyncio.gather(*(rt.kube.create(p) for p in plan.launch), return_exceptions=True)
        metrics.PODS_CREATED.inc(sum(1 for ok in created if ok is True))
        for pod, result in zip(plan.launch, created):
            if isinstance(result, ApiException) and result.status in rejections.REFUSALS:
                rej = rejections.from_api_error(result.status, result.body, pod, spec)
                log.warning("%s/%s: %s", namespace, name, rej.message)
                metrics.RECONCILE_ERRORS.labels(kind=f"refused{result.status}").inc()
                return rej
        errors = [r for r in created if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        existing = [p["metadata"]["name"] for p, ok in zip(plan.launch, created) if not ok]
        if existing and not await rt.kube.pods_owned_by(namespace, existing, job.uid):
            # A pod of a deleted job with the same name still exists (garbage collection
            # has not caught up): the gang is not launched until it is gone.
            rt.enqueue(key, 1.0)
            return None
        await rt.kube.merge_status(namespace, name, plan.launched_status or {})
    if plan.delete_job:
        await rt.kube.delete_job(namespace, name, body["metadata"]["uid"])
    for ev in plan.events:
        try:
            await rt.kube.post_event(body, ev.type, ev.reason, ev.message)
        except ApiException as err:  # an event is best effort; the status already says it
            log.info("event %s for %s/%s not posted: %s", ev.reason, namespace, name, err.reason)
    if plan.restart_cause:
        metrics.RESTARTS.labels(cause=plan.restart_cause).inc()
    current = new or status.parse(body.get("status"))
    rt.phases.set(key, current.phase, current.progress)
    phase = current.phase
    if phase in TERMINAL and rt.scraper:
        rt.scraper.forget(key)
    if plan.requeue_after is not None and not plan.delete_job:
        rt.enqueue(key, plan.requeue_after)
    return None
