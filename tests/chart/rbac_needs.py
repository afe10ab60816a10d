"""Why the operator needs each verb the chart grants, and a probe that exercises it.

`NEEDS` maps (apiGroup, resource, verb) to the operator code path that makes the call and
a probe: an async function that makes the same API request the code path makes, through
`sftjob_operator.kube.Kube` where the operator itself goes through it, with the operator's
ServiceAccount token. A probe raises `ApiException(403)` when the verb is not granted.

The unit test checks that the chart's rules grant exactly the verbs in this table; the
cluster test takes each verb away in turn and checks that its probe is refused while the
other verbs still work. What that proves: each granted verb is used by the named code path
and is not implied by another rule. What it does not prove on its own: that the operator
fails visibly without it (kopf, for instance, degrades to a warning without the CRD watch);
the table says what breaks.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

import kubernetes
from kubernetes.client.exceptions import ApiException

from sftjob_operator import api, builders
from sftjob_operator.kube import Kube
from sftjob_operator.leader import LeaseLock

Probe = Callable[["ProbeContext"], Awaitable[Any]]


@dataclass
class ProbeContext:
    kube: Kube              # the operator's client, with the ServiceAccount's token
    namespace: str          # where the probe job lives
    job: dict[str, Any]     # a suspended SFTJob in that namespace, as read by the admin
    node: str               # a Node name
    lease: str = "sftjob-sftjob-operator"   # the leader-election Lease (in `namespace`)

    @property
    def ref(self) -> builders.JobRef:
        return builders.JobRef.from_body(self.job)

    @property
    def spec(self) -> api.SFTJobSpec:
        return builders.parse_spec(self.job["spec"])


def _watch(what: str) -> Probe:
    """kopf's watch request (GET ...?watch=true); a 1-second server timeout ends it."""
    async def probe(ctx: ProbeContext) -> Any:
        kw = {"watch": True, "timeout_seconds": 1, "_preload_content": False, "_request_timeout": 10}
        if what == "sftjobs":
            return await asyncio.to_thread(ctx.kube.custom.list_cluster_custom_object, api.GROUP, api.VERSION,
                                           api.PLURAL, **kw)
        if what == "pods":
            return await asyncio.to_thread(ctx.kube.core.list_namespaced_pod, ctx.namespace, **kw)
        return await asyncio.to_thread(_crds(ctx).list_custom_resource_definition, **kw)
    return probe


def _crds(ctx: ProbeContext) -> kubernetes.client.ApiextensionsV1Api:
    return kubernetes.client.ApiextensionsV1Api(ctx.kube.client)


async def _list_crds(ctx):
    return await asyncio.to_thread(_crds(ctx).list_custom_resource_definition, limit=1, _preload_content=False)


async def _get_job(ctx):
    assert await ctx.kube.get_job(ctx.namespace, ctx.job["metadata"]["name"]) is not None


async def _list_jobs(ctx):
    await ctx.kube.list_jobs(None)


async def _patch_job(ctx):
    # kopf keeps its progress and last-handled spec in annotations (AnnotationsProgressStorage).
    meta = ctx.job["metadata"]
    await asyncio.to_thread(ctx.kube.custom.patch_namespaced_custom_object, api.GROUP, api.VERSION,
                            meta["namespace"], api.PLURAL, meta["name"],
                            {"metadata": {"annotations": {"kopf.sftjob.io/rbac-probe": "1"}}})


async def _delete_job(ctx):
    # The precondition on a uid that never existed makes the authorized call a no-op (409,
    # swallowed by delete_job); authorization is checked before the precondition.
    await ctx.kube.delete_job(ctx.namespace, ctx.job["metadata"]["name"], "00000000-0000-0000-0000-000000000000")


async def _patch_status(ctx):
    await ctx.kube.merge_status(ctx.namespace, ctx.job["metadata"]["name"], {})


async def _get_pod(ctx):
    # pods_owned_by reads each pod by name; a missing one is a 404 (False), not an error.
    assert await ctx.kube.pods_owned_by(ctx.namespace, ["rbac-probe-absent"], ctx.job["metadata"]["uid"]) is False


async def _list_pods(ctx):
    await ctx.kube.list_pods(ctx.namespace, ctx.job["metadata"]["name"])


def _dry_run_create(kind: str) -> Probe:
    """The manifest the reconciler creates, created with dryRun=All (same authorization)."""
    async def probe(ctx: ProbeContext) -> Any:
        core, ns = ctx.kube.core, ctx.namespace
        if kind == "Pod":
            fn, body = core.create_namespaced_pod, builders.build_pod(ctx.ref, ctx.spec, rank=0, attempt=0)
        elif kind == "Service":
            fn, body = core.create_namespaced_service, builders.build_service(ctx.ref)
        elif kind == "ConfigMap":
            fn, body = core.create_namespaced_config_map, builders.build_config_map(ctx.ref, ctx.spec)
        elif kind == "NetworkPolicy":
            fn, body = ctx.kube.networking.create_namespaced_network_policy, builders.build_network_policy(ctx.ref, [])
        else:  # the Event post_event writes
            fn, body = core.create_namespaced_event, {
                "metadata": {"generateName": "rbac-probe.", "namespace": ns},
                "involvedObject": {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
                                   "name": ctx.job["metadata"]["name"], "namespace": ns,
                                   "uid": ctx.job["metadata"]["uid"]},
                "type": "Normal", "reason": "RBACProbe", "message": "probe",
                "source": {"component": "sftjob-operator"}}
        return await asyncio.to_thread(fn, ns, body, dry_run="All")
    return probe


async def _delete_pod(ctx):
    await ctx.kube.delete_pod(ctx.namespace, "rbac-probe-absent")  # 404 is swallowed, 403 is not


def _read_child(kind: str) -> Probe:
    async def probe(ctx: ProbeContext) -> Any:
        # children.ensure reads a same-named Service/ConfigMap to check its owner; absent: None.
        assert await ctx.kube.read({"kind": kind, "metadata": {"name": "rbac-probe-absent",
                                                               "namespace": ctx.namespace}}) is None
    return probe


async def _patch_config_map(ctx):
    # children.ensure patches an existing ConfigMap's data; the probe's target does not
    # exist, so an authorized call answers 404.
    try:
        await asyncio.to_thread(ctx.kube.core.patch_namespaced_config_map, "rbac-probe-absent", ctx.namespace,
                                {"data": {}})
    except ApiException as err:
        if err.status != 404:
            raise


async def _get_node(ctx):
    # node_ready() swallows 403 (and remembers it); the probe reads the node the same way
    # but lets the refusal through.
    await asyncio.to_thread(ctx.kube.core.read_node, ctx.node, _preload_content=False)


async def _list_nodes(ctx):
    # list_nodes() turns a 403 into None (no elastic sizing); the probe lets it through.
    await asyncio.to_thread(ctx.kube.core.list_node, limit=1, _preload_content=False)


def _lease_lock(ctx: ProbeContext) -> LeaseLock:
    return LeaseLock(ctx.namespace, ctx.lease, ctx.kube.client)


async def _get_lease(ctx):
    # leader.LeaseLock.get: an absent Lease is None (404), a refusal raises.
    await asyncio.to_thread(_lease_lock(ctx).get, 10)


async def _create_lease(ctx):
    # leader.LeaseLock.create, as the first candidate calls it, with dryRun=All. The test has
    # created the Lease already: an authorized create answers 409 (authorization comes first).
    try:
        await asyncio.to_thread(_lease_lock(ctx).create, {"holderIdentity": "rbac-probe",
                                                          "leaseDurationSeconds": 15}, 10, True)
    except ApiException as err:
        if err.status != 409:
            raise


async def _update_lease(ctx):
    # leader.LeaseLock.update (renew, take over, release): conditional on a resourceVersion,
    # here a stale one, so an authorized call on the Lease the test created answers 409 and
    # changes nothing. (A PUT of a missing Lease would create it: create-on-update.)
    meta = {"name": ctx.lease, "namespace": ctx.namespace, "resourceVersion": "1"}
    try:
        await asyncio.to_thread(_lease_lock(ctx).update, {"metadata": meta}, {"holderIdentity": "rbac-probe"}, 10)
    except ApiException as err:
        if err.status != 409:
            raise


# (apiGroup, resource, verb) -> (who needs it, probe)
NEEDS: dict[tuple[str, str, str], tuple[str, Probe]] = {
    ("sftjob.io", "sftjobs", "get"): ("kube.get_job: every reconcile pass reads the job fresh", _get_job),
    ("sftjob.io", "sftjobs", "list"): ("kopf's initial listing; kube.list_jobs: the 60 s resync", _list_jobs),
    ("sftjob.io", "sftjobs", "watch"): ("kopf watch behind on_job/on_job_event (create, update, delete)",
                                        _watch("sftjobs")),
    ("sftjob.io", "sftjobs", "patch"): ("kopf: progress and last-handled-configuration annotations", _patch_job),
    ("sftjob.io", "sftjobs", "delete"): ("kube.delete_job: ttlSecondsAfterFinished (ttl.py)", _delete_job),
    ("sftjob.io", "sftjobs/status", "patch"): ("kube.patch_status / merge_status: every status write",
                                               _patch_status),
    ("", "pods", "get"): ("kube.pods_owned_by: a same-named pod of a deleted job blocks the launch", _get_pod),
    ("", "pods", "list"): ("kube.list_pods (every pass); kopf's pod listing", _list_pods),
    ("", "pods", "watch"): ("kopf watch behind on_pod_event (a pod change requeues its job)",
                            _watch("pods")),
    ("", "pods", "create"): ("kube.create: the gang's pods (builders.build_pod)", _dry_run_create("Pod")),
    ("", "pods", "delete"): ("kube.delete_pod: gang restart, suspend, cleanPodPolicy", _delete_pod),
    ("", "services", "create"): ("children.ensure: the headless Service (builders.build_service)",
                                 _dry_run_create("Service")),
    ("", "services", "get"): ("children.ensure: an existing Service of the job's name must be the job's",
                              _read_child("Service")),
    ("", "configmaps", "create"): ("children.ensure: the trainer config (builders.build_config_map)",
                                   _dry_run_create("ConfigMap")),
    ("", "configmaps", "get"): ("children.ensure: an existing ConfigMap of the config's name must be the job's",
                                _read_child("ConfigMap")),
    ("", "configmaps", "patch"): ("children.ensure: refresh the config of an existing job",
                                  _patch_config_map),
    ("networking.k8s.io", "networkpolicies", "create"): (
        "children.ensure: the job's NetworkPolicy (builders.build_network_policy; jobNetworkPolicy.enabled)",
        _dry_run_create("NetworkPolicy")),
    ("networking.k8s.io", "networkpolicies", "get"): (
        "children.ensure: an existing NetworkPolicy of the job's policy name must be the job's",
        _read_child("NetworkPolicy")),
    ("", "events", "create"): ("kube.post_event (and kopf's warning events)", _dry_run_create("Event")),
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"): (
        "kopf resource observer: lists CRDs before watching them", _list_crds),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"): (
        "kopf resource observer: notices the SFTJob CRD appear or change (an operator started "
        "before its CRD is established, a CRD upgrade); without it kopf only warns and never "
        "serves a CRD it did not see at start-up", _watch("crds")),
    ("", "nodes", "get"): ("kube.node_ready: a NotReady node restarts the gang at once (rbac.readNodes)",
                           _get_node),
    ("", "nodes", "list"): ("kube.list_nodes: how many nodes can host a pod of an elastic job (rbac.readNodes)",
                            _list_nodes),
    # Leader election (leader.py), in the release namespace, on the one Lease by name
    # (create cannot be limited by name).
    ("coordination.k8s.io", "leases", "get"): (
        "leader.LeaderElector: every standby poll and leader renewal reads the Lease", _get_lease),
    ("coordination.k8s.io", "leases", "create"): (
        "leader.LeaderElector: the first replica ever creates the Lease", _create_lease),
    ("coordination.k8s.io", "leases", "update"): (
        "leader.LeaderElector: renew (else the leader exits), take over, release on shutdown", _update_lease),
}
LEASE_KEYS = {k for k in NEEDS if k[:2] == ("coordination.k8s.io", "leases")}


def sa_kube(server: str, cafile: str, token: str) -> Kube:
    conf = kubernetes.client.Configuration()
    conf.host = server
    conf.ssl_ca_cert = cafile
    conf.api_key = {"authorization": f"Bearer {token}"}
    return Kube(kubernetes.client.ApiClient(conf))


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Expand RBAC rules into (apiGroup, resource, verb) triples. Only the Lease rule may be
    limited to names (the tests check which)."""
    out = set()
    for rule in rules:
        assert not rule.get("nonResourceURLs"), rule
        assert not rule.get("resourceNames") or rule["resources"] == ["leases"], rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, res, verb))
    return out


async def refused(ctx: ProbeContext, key: tuple[str, str, str]) -> bool:
    """True when the probe is refused (403), False when it succeeds; other errors raise."""
    try:
        resp = await NEEDS[key][1](ctx)
        if hasattr(resp, "close"):  # a streamed (watch) or unread response
            resp.close()
        return False
    except ApiException as err:
        if err.status == 403:
            return True
        raise
