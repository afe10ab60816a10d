"""The few Kubernetes API calls the reconciler makes, as plain-dict async functions.

The official client is synchronous; calls run in worker threads. Objects come back as the
API server's own JSON (camelCase dicts), the same shape the pure code and kopf use.
Idempotency lives here: create tolerates AlreadyExists, delete tolerates NotFound.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime
from collections.abc import Callable, Coroutine
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from . import api
from .builders import LABEL_JOB
from .nodes import NodeLease, NodeReadiness
from .status import observed_time

log = logging.getLogger("sftjob_operator")

NODE_LEASE_NAMESPACE = "kube-node-lease"  # where each kubelet renews the Lease named like its node


# (connect, read) seconds for every API call: a call that hangs (a half-open connection, an
# overloaded API server) fails and is retried instead of freezing its job's reconcile for good.
API_TIMEOUT = (5.0, 30.0)


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
    return asyncio.to_thread(fn, *args, _request_timeout=API_TIMEOUT, **kwargs)


class Conflict(Exception):
    """The object changed since it was read; re-read and try again."""


def api_client(pool: int = 32) -> kubernetes.client.ApiClient:
    """The operator's API client: in-cluster credentials in a pod, else the kubeconfig. One
    construction for every caller (the reconciler's `Kube`, the leader election). Pods of many
    jobs are created and deleted concurrently: the default pool of 4 connections would be
    reopened over and over."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    conf = kubernetes.client.Configuration.get_default_copy()
    conf.connection_pool_maxsize = pool
    return kubernetes.client.ApiClient(conf)


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient | None = None):
        client = client or api_client()
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.coordination = kubernetes.client.CoordinationV1Api(client)
        self.networking = kubernetes.client.NetworkingV1Api(client)
        self._nodes: dict[str, tuple[float, NodeReadiness | None]] = {}
        self._nodes_forbidden = False
        self._leases_forbidden = False
        self._node_list: tuple[float, list[dict[str, Any]] | None] = (-1e9, None)

    @staticmethod
    async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        resp = await _run(fn, *args, _preload_content=False, **kwargs)
        data = resp.data
        return json.loads(data) if data else None

    # -- SFTJobs --------------------------------------------------------------------------
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            job: dict[str, Any] | None = await self._call(self.custom.get_namespaced_custom_object,
                                                          api.GROUP, api.VERSION, namespace, api.PLURAL, name)
            return job
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    async def list_jobs(self, namespaces: list[str] | None) -> list[dict[str, Any]]:
        if not namespaces:
            res = await self._call(self.custom.list_cluster_custom_object, api.GROUP, api.VERSION, api.PLURAL)
            everywhere: list[dict[str, Any]] = res["items"]
            return everywhere
        items: list[dict[str, Any]] = []
        for ns in namespaces:
            res = await self._call(self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION, ns, api.PLURAL)
            items += res["items"]
        return items

    async def patch_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the status (status.merge_patch), guarded by the resourceVersion we read."""
        meta = body["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        try:
            patched: dict[str, Any] = await _run(
                self.custom.patch_namespaced_custom_object_status,
                api.GROUP, api.VERSION, meta["namespace"], api.PLURAL, meta["name"], patch)
            return patched
        except ApiException as err:
            if err.status == 409:
                raise Conflict(str(err.reason)) from None
            raise

    async def merge_status(self, namespace: str, name: str, fields: dict[str, Any]) -> None:
        await _run(self.custom.patch_namespaced_custom_object_status,
                                api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": fields})

    async def delete_job(self, namespace: str, name: str, uid: str) -> None:
        body = kubernetes.client.V1DeleteOptions(propagation_policy="Background",
                                                 preconditions=kubernetes.client.V1Preconditions(uid=uid))
        try:
            await _run(self.custom.delete_namespaced_custom_object,
                                    api.GROUP, api.VERSION, namespace, api.PLURAL, name, body=body)
        except ApiException as err:
            if err.status not in (404, 409):
                raise

    # -- children -------------------------------------------------------------------------
    async def list_pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        res = await self._call(self.core.list_namespaced_pod, namespace, label_selector=f"{LABEL_JOB}={job_name}")
        pods: list[dict[str, Any]] = res["items"]
        return pods

    async def create(self, manifest: dict[str, Any]) -> bool:
        """Create a Pod, Service, ConfigMap or NetworkPolicy; False when it already exists."""
        ns = manifest["metadata"]["namespace"]
        creators: dict[str, Callable[..., Any]] = {
            "Pod": self.core.create_namespaced_pod, "Service": self.core.create_namespaced_service,
            "ConfigMap": self.core.create_namespaced_config_map,
            "NetworkPolicy": self.networking.create_namespaced_network_policy}
        fn = creators[manifest["kind"]]
        try:
            await _run(fn, ns, manifest)
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    async def read(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The stored Service, ConfigMap or NetworkPolicy of `manifest`'s name; None: absent."""
        meta = manifest["metadata"]
        fn = {"Service": self.core.read_namespaced_service,
              "ConfigMap": self.core.read_namespaced_config_map,
              "NetworkPolicy": self.networking.read_namespaced_network_policy}[manifest["kind"]]
        try:
            found = await self._call(fn, meta["name"], meta["namespace"])
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return {"kind": manifest["kind"], **found}

    async def patch_config_map_data(self, manifest: dict[str, Any]) -> None:
        """Bring a ConfigMap's data up to date (the grace period may change)."""
        meta = manifest["metadata"]
        await _run(self.core.patch_namespaced_config_map, meta["name"], meta["namespace"], {"data": manifest["data"]})

    async def pods_owned_by(self, namespace: str, names: list[str], uid: str) -> bool:
        """Whether every named pod exists and belongs to the job with this uid."""
        for name in names:
            try:
                pod = await self._call(self.core.read_namespaced_pod, name, namespace)
            except ApiException as err:
                if err.status == 404:
                    return False
                raise
            if not any(o.get("uid") == uid for o in pod["metadata"].get("ownerReferences") or []):
                return False
        return True

    async def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None,
                         uid: str | None = None) -> None:
        """Delete a pod (its own grace period, or `grace_period_seconds`: 0 for a pod on a
        lost node, which no kubelet will ever confirm). With `uid`, only that pod: pod names
        repeat across attempts, and a delete decided on an older listing must not reach the
        next attempt's pod of the same name (the API server answers 409; nothing to do)."""
        body = kubernetes.client.V1DeleteOptions(
            grace_period_seconds=grace_period_seconds,
            preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None)
        try:
            await _run(self.core.delete_namespaced_pod, name, namespace, body=body)
        except ApiException as err:
            if err.status == 409 and uid:
                log.info("pod %s/%s is no longer uid %s: not deleted", namespace, name, uid)
                return
            if err.status != 404:
                raise

    async def node_leases(self, names: set[str]) -> dict[str, NodeLease]:
        """The heartbeat Lease (kube-node-lease) of the given nodes; a node without one, or all
        of them when RBAC forbids reading (`rbac.readNodes`), is left out."""
        out: dict[str, NodeLease] = {}
        if self._leases_forbidden:
            return out
        for name in names:
            try:
                lease = await self._call(self.coordination.read_namespaced_lease, name, NODE_LEASE_NAMESPACE)
            except ApiException as err:
                if err.status == 403:
                    self._leases_forbidden = True
                    return {}
                continue
            spec = lease.get("spec") or {}
            try:
                renewed = datetime.fromisoformat(spec["renewTime"])
                out[name] = NodeLease(renewed=renewed, duration_s=float(spec.get("leaseDurationSeconds") or 40))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    async def node_ready(self, names: set[str]) -> dict[str, NodeReadiness]:
        """Ready condition of the given nodes (cached 5 s); empty when RBAC forbids reading."""
        out: dict[str, NodeReadiness] = {}
        if self._nodes_forbidden:
            return out
        now = time.monotonic()
        for name in names:
            cached = self._nodes.get(name)
            if cached and now - cached[0] < 5.0:
                ready = cached[1]
            else:
                try:
                    node = await self._call(self.core.read_node, name)
                    conds = (node.get("status") or {}).get("conditions") or []
                    cond = next((x for x in conds if x.get("type") == "Ready"), None)
                    ready = None if cond is None else NodeReadiness(cond.get("status") == "True",
                                                                     observed_time(cond.get("lastTransitionTime")))
                except ApiException as err:
                    if err.status == 403:
                        self._nodes_forbidden = True
                        return {}
                    ready = NodeReadiness(False) if err.status == 404 else None  # a deleted node is lost
                self._nodes[name] = (now, ready)
            if ready is not None:
                out[name] = ready
        return out

    async def list_nodes(self) -> list[dict[str, Any]] | None:
        """Every Node (cached 5 s), for an elastic job's sizing; None when RBAC forbids listing."""
        now = time.monotonic()
        if now - self._node_list[0] < 5.0:
            return self._node_list[1]
        try:
            items: list[dict[str, Any]] | None = (await self._call(self.core.list_node)).get("items") or []
        except ApiException as err:
            if err.status != 403:
                raise
            items = None
        self._node_list = (now, items)
        return items

    async def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the SFTJob (what `kubectl describe sft` shows)."""
        meta = body["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": "sftjob-operator"}, "reportingComponent": "sftjob-operator",
            "reportingInstance": "sftjob-operator",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        await _run(self.core.create_namespaced_event, meta["namespace"], event)
