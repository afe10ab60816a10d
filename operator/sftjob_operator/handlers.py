"""kopf wiring: every trigger leads to the same idempotent `reconcile_job`.

Triggers: SFTJob create/resume/spec update (kopf handlers, so kopf's error taxonomy
applies), pod events (enqueue the owning job), and the work queue (workqueue.py), which
plays the role of a timer. One pass: read the job and its pods, observe (observe.py), decide
(reconcile.py, pure), act (act.py). The process's state is a Runtime (runtime.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from datetime import datetime, UTC
from typing import Any, cast

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from . import act, api, builders, metrics, progress, reconcile, status, workqueue
from . import conditions as c
from .kube import Conflict, Kube
from .observe import observe
from .plan import Plan
from .runtime import Runtime
from .settings import Settings
from .workqueue import ERROR_RETRY_S, RESYNC_S, Key

log = logging.getLogger("sftjob_operator")

# Threads for the (synchronous) Kubernetes client calls of all passes together; asyncio's
# default pool has cpu+4 (6 on 2 cores), which held 16 passes and kopf's handlers back.
API_THREADS = 32


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
    rt.task = asyncio.create_task(workqueue.run(rt.queue, lambda key: reconcile_job(rt, *key), lambda: resync(rt)),
                                  name="sftjob-scheduler")
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
    age = time.monotonic() - _rt(memo).queue.last_tick
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
        _rt(memo).forget((namespace, name))


@kopf.on.event("", "v1", "pods", labels={builders.LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # kopf: namespace: str | None; ours are namespaced
def on_pod_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    _rt(memo).enqueue((namespace, labels[builders.LABEL_JOB]), urgent=True)


async def resync(rt: Runtime) -> None:
    """Queue a pass for every job (what a missed event left behind)."""
    for job in await rt.kube.list_jobs(rt.namespaces):
        meta = job["metadata"]
        rt.enqueue((meta["namespace"], meta["name"]))
        # One job's unreadable status must not keep the jobs after it from their pass.
        with contextlib.suppress(ValidationError):
            rt.phases.set((meta["namespace"], meta["name"]), status.parse(job.get("status")).phase)


async def reconcile_job(rt: Runtime, namespace: str, name: str, from_handler: bool = False) -> None:
    """One reconcile pass for one job: read, decide (pure), write status, act."""
    key = (namespace, name)
    async with rt.queue.lock(key):
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
    seen = await observe(rt, key, body, pods)
    # A pod the API server refused in the previous pass: this pass decides with it (fail naming
    # the field, or wait for quota), from the status that pass wrote.
    refused = rt.refused.pop(key, None)
    plan = reconcile.plan(body, pods, datetime.now(UTC), seen.node_ready, seen.metrics, refused, seen.node_leases,
                          rt.observing_since, seen.cluster_nodes)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    rejection = await act.apply_plan(rt, key, body, plan, uids)
    if plan.checkpoint_hold_s is not None and rt.scraper is not None and rt.session is not None:  # a planned stop
        if failed := await progress.ask_checkpoint(rt.session, rt.scraper.targets.get(key), plan.checkpoint_hold_s):
            await rt.kube.merge_status(namespace, name, {"checkpointRequest": {"failed": failed}})
            rt.enqueue(key, 0.5)
    if rejection is not None:
        # One status write per pass: the refusal is decided on by the next pass, at once.
        rt.refused[key] = rejection
        rt.enqueue(key, urgent=True)
    return plan
