"""The job's other children, its headless Service, its ConfigMap and (with the operator's
--job-network-policy) its NetworkPolicy: created once per launch, and trusted only when
they carry this job's ownerReference.

A 409 on create used to be taken as "already ours": a user's ConfigMap of the same name was
overwritten, and an existing ClusterIP Service meant no per-rank DNS names, a 300 s wait in
every rank, then a failure charged to the budget. A refused create (a full `services`
quota, a policy engine's denial, a ConfigMap over 1 MiB) retried every 5 s forever with the
job Pending; it now fails or waits exactly as a refused pod does (rejections.py).
"""
from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from . import api, builders, metrics, rejections
from .kube import Kube
from .rejections import Rejection


async def ensure(kube: Kube, job: builders.JobRef, spec: api.SFTJobSpec,
                 network_policy: dict[str, Any] | None = None) -> tuple[Rejection | None, bool]:
    """Create the job's headless Service and ConfigMap, or check that the existing ones are
    this job's: (the refusal that fails or holds the job, whether to wait and look again).
    A name held by anyone else is never taken over (a user's ConfigMap was overwritten, a
    ClusterIP Service meant no DNS for the ranks)."""
    wanted = [builders.build_service(job), builders.build_config_map(job, spec)]
    if network_policy is not None:   # before any pod exists, so no rank is ever reachable without it
        wanted.append(network_policy)
    for manifest in wanted:
        try:
            if await kube.create(manifest):
                continue
        except ApiException as err:
            if err.status in rejections.REFUSALS:
                metrics.RECONCILE_ERRORS.labels(kind=f"refused{err.status}").inc()
                return rejections.from_child_error(err.status, err.body, manifest), False
            raise
        existing = await kube.read(manifest)
        owner = rejections.child_owner(existing, job.name, job.uid) if existing else "previous"
        if owner == "previous" or not existing:  # an earlier job's, on its way out (or just deleted): look again
            return None, True
        if owner == "taken":
            return rejections.name_taken(existing), False
        if manifest["kind"] == "ConfigMap" and existing.get("data") != manifest["data"]:
            await kube.patch_config_map_data(manifest)
    return None, False
