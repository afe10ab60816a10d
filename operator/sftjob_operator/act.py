"""Carrying out a reconcile pass's Plan (plan.py) against the API: the status first, then pod
deletions, the job's children and pod creations, the job's deletion, Events, and when to look
again. The decision is reconcile.py's; this module only acts on it, in that order."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import builders, children, metrics, rejections, status
from .phases import TERMINAL
from .plan import Plan
from .runtime import Runtime
from .workqueue import Key

log = logging.getLogger("sftjob_operator")


async def apply_plan(rt: Runtime, key: Key, body: dict[str, Any], plan: Plan,
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
