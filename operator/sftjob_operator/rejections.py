"""When the API server refuses a pod of the gang, or a pod waits: which spec field is to
blame, and whether waiting can help. Pure; no I/O.

The CRD rejects most bad specs at `kubectl apply`. What only pod admission or the state of
the cluster can judge reaches the operator as an error on `create pod`: a 422 from pod
validation (its causes name pod fields), or a 403 from an admission plugin (a PriorityClass
or ServiceAccount that does not exist, a LimitRange, Pod Security, a ResourceQuota). Each
pod field is mapped back to the SFTJob field it was built from, so the job's Failed
condition says what to change.

Policy: every refusal fails the job at once, except a namespace ResourceQuota that the
gang would fit into once other workloads finish (`used + requested > hard`, but
`requested <= hard`): then the job waits, saying so, until its startup deadline.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from . import api
from . import conditions as c
from . import failure_policy as fp
from . import deadlines, queueing
from .jobpass import QUOTA_RETRY_S, STARTING_POLL_S, Gang, Pass
from .phases import Phase
from .status import iso, parse_time


# HTTP statuses of `create pod` that mean "this pod, as built, is refused" (not a passing
# fault): 400 bad request, 403 admission/quota, 404 a referenced object, 422 validation.
REFUSALS = (400, 403, 404, 422)


@dataclass(frozen=True)
class Rejection:
    reason: str        # condition reason: PodRejected or QuotaExceeded
    message: str       # names the spec field where one is to blame
    permanent: bool    # False: waiting may help (quota held by other workloads)


# Pod field prefixes (after `spec.containers[0].`/`spec.`) -> the SFTJob field they come from.
_CONTAINER_FIELDS = (
    ("resources.requests.memory", "spec.resources.memory"),
    ("resources.limits.memory", "spec.resources.memory"),
    ("resources.requests[memory]", "spec.resources.memory"),
    ("resources.limits[memory]", "spec.resources.memory"),
    ("resources.requests.cpu", "spec.resources.cpu"),
    ("resources.requests[cpu]", "spec.resources.cpu"),
    ("resources.limits.nvidia.com/gpu", "spec.resources.gpusPerNode"),
    ("resources.requests[nvidia.com/gpu]", "spec.resources.gpusPerNode"),
    ("resources", "spec.resources"),
    ("image", "spec.resources.image"),
    ("imagePullPolicy", "spec.resources.imagePullPolicy"),
    ("volumeMounts", "spec.storage.uri"),
)
_POD_FIELDS = (
    ("tolerations", "spec.resources.tolerations"),
    ("nodeSelector", "spec.resources.nodeSelector"),
    ("priorityClassName", "spec.resources.priorityClassName"),
    ("priority", "spec.resources.priorityClassName"),
    ("schedulerName", "spec.resources.schedulerName"),
    ("serviceAccountName", "spec.resources.serviceAccountName"),
    ("volumes", "spec.storage.persistentVolumeClaim"),
    ("terminationGracePeriodSeconds", "spec.runPolicy.terminationGracePeriodSeconds"),
)
# 403 messages of admission plugins -> the SFTJob field they are about.
_FORBIDDEN = (
    (re.compile(r"no PriorityClass with name (\S+) was found"), "spec.resources.priorityClassName"),
    (re.compile(r"service ?account", re.I), "spec.resources.serviceAccountName"),
    (re.compile(r"violates PodSecurity"), "spec.resources (the namespace's Pod Security level)"),
    (re.compile(r"(memory|cpu).*(limit|request)|(limit|request).*(memory|cpu)", re.I),
     "spec.resources.cpu / spec.resources.memory (a LimitRange)"),
)


def _status(body: Any) -> dict[str, Any]:
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            return {"message": str(body)}
    return body if isinstance(body, dict) else {}


def spec_field(pod_field: str, pod: dict[str, Any], spec: api.SFTJobSpec) -> str:
    """The SFTJob field behind one pod field path, e.g. spec.tolerations[1].operator ->
    spec.resources.tolerations[1].operator; the pod field itself when nothing maps."""
    m = re.match(r"spec\.(?:initContainers|containers)\[\d+\]\.(.*)$", pod_field)
    if m:
        rest = m.group(1)
        env = re.match(r"env\[(\d+)\](.*)$", rest)
        if env:
            containers = pod.get("spec", {}).get("containers") or [{}]
            envs = containers[0].get("env") or []
            index = int(env.group(1))
            name = envs[index]["name"] if index < len(envs) else None
            users = [v.name for v in spec.resources.env or []]
            if name in users:
                return f"spec.resources.env[{users.index(name)}]{env.group(2)} ({name})"
            return f"pod {pod_field}"
        for prefix, target in _CONTAINER_FIELDS:
            if rest == prefix or rest.startswith((prefix + ".", prefix + "[")):
                return target
        return f"pod {pod_field}"
    m = re.match(r"spec\.(.*)$", pod_field)
    if m:
        rest = m.group(1)
        for prefix, target in _POD_FIELDS:
            if rest == prefix or rest.startswith((prefix + ".", prefix + "[")):
                return target + rest[len(prefix):]
    return f"pod {pod_field}" if pod_field else "the pod"


def from_api_error(status: int, body: Any, pod: dict[str, Any], spec: api.SFTJobSpec) -> Rejection:
    """Turn the API server's refusal of `pod` (HTTP status, Status body) into a Rejection."""
    st = _status(body)
    message = st.get("message") or f"HTTP {status}"
    causes = (st.get("details") or {}).get("causes") or []
    if status == 403 and "exceeded quota" in message:
        return _quota(message)
    if status == 403 and "status unknown for quota" in message:
        # A new ResourceQuota whose usage the controller has not counted yet: soon known.
        return Rejection(c.REASON_QUOTA_EXCEEDED, f"waiting for the namespace quota to be counted: {message}",
                         permanent=False)
    fields = []
    for cause in causes:
        name = spec_field(cause.get("field", ""), pod, spec)
        fields.append(f"{name}: {cause.get('message') or cause.get('reason', '')}".strip())
    if not fields and status == 403:
        for pattern, name in _FORBIDDEN:
            if pattern.search(message):
                fields.append(f"{name}: {message}")
                break
    detail = "; ".join(fields) if fields else message
    return Rejection(c.REASON_POD_REJECTED,
                     f"the API server refused pod {pod['metadata']['name']}: {detail}", permanent=True)


# -- the job's Service and ConfigMap ------------------------------------------------------

# What each child is built from, for a message that says what to change.
_CHILD_ROLE = {"Service": "the headless Service that gives the ranks their DNS names",
               "ConfigMap": "the trainer configuration, built from spec.model, spec.data and spec.training",
               "NetworkPolicy": "the policy that lets only the job's own pods reach its ranks"}


def from_child_error(status: int, body: Any, manifest: dict[str, Any]) -> Rejection:
    """The API server refused the job's Service or ConfigMap: a count quota that others fill
    is waited for like a pod's; anything else (a quota of zero, a policy engine's denial, a
    ConfigMap over 1 MiB) fails the job naming the object."""
    message = _status(body).get("message") or f"HTTP {status}"
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    what = f"{kind} {name} ({_CHILD_ROLE.get(kind, kind)})"
    if status == 403 and "exceeded quota" in message:
        parts = dict(re.findall(r"(requested|used|limited): ([^:]*?)(?=, (?:requested|used|limited):|$)", message))
        requested, limited = _amounts(parts.get("requested", "")), _amounts(parts.get("limited", ""))
        if any(k in limited and v > limited[k] for k, v in requested.items()):
            return Rejection(c.REASON_QUOTA_EXCEEDED, f"the namespace quota allows no {what}: {message}; "
                             "raise the quota", permanent=True)
        return Rejection(c.REASON_QUOTA_EXCEEDED, f"waiting for namespace quota to create {what}: {message}",
                         permanent=False)
    return Rejection(c.REASON_OBJECT_REJECTED, f"the API server refused {what}: {message}", permanent=True)


def child_owner(existing: dict[str, Any], job_name: str, job_uid: str) -> str:
    """Whose the object holding the child's name is: 'ours', 'previous' (an earlier SFTJob of
    the same name, which garbage collection will remove) or 'taken' (anyone else's)."""
    owners = existing["metadata"].get("ownerReferences") or []
    if any(o.get("uid") == job_uid for o in owners):
        return "ours"
    if any(o.get("kind") == api.KIND and o.get("name") == job_name for o in owners):
        return "previous"
    return "taken"


def name_taken(existing: dict[str, Any]) -> Rejection:
    meta = existing["metadata"]
    owners = ", ".join(f"{o.get('kind')} {o.get('name')}" for o in meta.get("ownerReferences") or []) or "no owner"
    what = f"{existing.get('kind', 'object')} {meta['namespace']}/{meta['name']}"
    return Rejection(c.REASON_NAME_TAKEN,
                     f"{what} already exists and is not this job's ({owners}); this job needs the name for "
                     f"{_CHILD_ROLE.get(existing.get('kind', ''), 'itself')}: rename the SFTJob (metadata.name) "
                     "or remove that object", permanent=True)


# -- ResourceQuota ----------------------------------------------------------------------

_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
           "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
           "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
           "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
           "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


def parse_quantity(text: str) -> Decimal | None:
    """A Kubernetes quantity (500m, 64Gi, 1e3) as a number; None when it is not one."""
    m = _QUANTITY.match(text.strip())
    if not m or m.group(2) not in _SUFFIX:
        return None
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2)]
    except InvalidOperation:
        return None


def _amounts(text: str) -> dict[str, Decimal]:
    out = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        amount = parse_quantity(value) if value else None
        if key and amount is not None:
            out[key] = amount
    return out


def _quota(message: str) -> Rejection:
    """`exceeded quota: NAME, requested: K=V,..., used: K=V,..., limited: K=V,...`"""
    parts = dict(re.findall(r"(requested|used|limited): ([^:]*?)(?=, (?:requested|used|limited):|$)", message))
    requested, limited = _amounts(parts.get("requested", "")), _amounts(parts.get("limited", ""))
    never = [k for k, v in requested.items() if k in limited and v > limited[k]]
    if never:
        return Rejection(c.REASON_QUOTA_EXCEEDED,
                         f"spec.resources: one pod asks for more than the namespace quota allows ({message}); "
                         "lower spec.resources.cpu/memory/gpusPerNode or raise the quota", permanent=True)
    return Rejection(c.REASON_QUOTA_EXCEEDED,
                     f"waiting for namespace quota held by other workloads: {message}", permanent=False)


def explain_waiting(spec: api.SFTJobSpec, reason: str, message: str) -> str:
    """Why a pod waits, naming the spec field behind it where one is (a Secret reference)."""
    if not reason:
        return ""
    text = f"{reason}: {message}" if message else reason
    refs = []
    if spec.storage.credentials_secret_ref:
        refs.append(("spec.storage.credentialsSecretRef.name", spec.storage.credentials_secret_ref.name))
    for var in spec.resources.env or []:
        src = var.value_from
        ref = src and (src.secret_key_ref or src.config_map_key_ref)
        if ref:
            refs.append((f"spec.resources.env[{var.name}].valueFrom", ref.name))
    t = spec.tracking
    if t.mlflow is not None and t.mlflow.credentials_secret:
        refs.append(("spec.tracking.mlflow.credentialsSecret", t.mlflow.credentials_secret))
    if t.wandb is not None and t.wandb.api_key_secret:
        refs.append(("spec.tracking.wandb.apiKeySecret", t.wandb.api_key_secret))
    for path, name in refs:
        # kubelet: 'secret "NAME" not found', or "couldn't find key K in Secret NS/NAME"
        if f'"{name}"' in message or message.rstrip().endswith(f"/{name}"):
            return f"{path} ({name}): {text}"
    if reason in fp.IMAGE_WAITING_REASONS:
        hint = " (the node has no such image and spec.resources.imagePullPolicy is Never: load the image onto " \
            "the nodes or allow pulls)" if reason == "ErrImageNeverPull" else ""
        return f"spec.resources.image ({spec.resources.image}): {text}{hint}"
    if reason == "Unschedulable":
        return f"{text} (check spec.resources: cpu, memory, gpusPerNode, nodeSelector, tolerations)"
    return text


# -- applied on a reconcile pass (jobpass.Pass), where the policy is stated ------------------

def apply(p: Pass, rej: Rejection, current: Gang) -> None:
    """The API server refused a pod of the gang. What no retry can fix fails the job, naming
    the spec field; a full namespace quota is waited for (saying so) until the startup deadline."""
    if rej.permanent:
        p.fail(rej.reason, rej.message)  # which stops the part of the gang that exists
        return
    rp = p.spec.run_policy
    # Waiting since the job last stopped being Ready (created, or restarted): stable across
    # the retries below, unlike restartAfter.
    ready = c.get_condition(p.st.conditions, c.READY)
    since = parse_time(ready.last_transition_time if ready else None) or p.now
    if deadlines.startup_left(since, rp.startup_deadline_seconds, p.now) <= 0:
        p.fail(c.REASON_STARTUP_DEADLINE,
               f"pods could not be created for {rp.startup_deadline_seconds}s "
               f"(runPolicy.startupDeadlineSeconds): {rej.message}")
        return
    if p.reason_changed_to(rej.reason):
        p.event("Warning", rej.reason, rej.message)
    p.set_phase(Phase.PENDING, rej.reason, rej.message)
    if current:
        # Part of the gang exists: it would hold quota while waiting for the rest (and its
        # rendezvous would time out). Retire it, uncounted, and try the whole gang again.
        p.stop(list(current.values()), finished_too=True)
        p.st.attempt += 1
    p.st.restart_after = iso(p.now + timedelta(seconds=QUOTA_RETRY_S))
    p.requeue(QUOTA_RETRY_S)


def while_starting(p: Pass, verdict: fp.GangVerdict, current: Gang) -> bool:
    """Pods not all running yet: say what they wait for (naming the field to blame), and fail
    the job at the startup deadline (deadlines.py: from creation, or from Kueue's admission)."""
    rp = p.spec.run_policy
    admitted = c.get_condition(p.st.conditions, queueing.ADMITTED)
    admitted_at = parse_time(admitted.last_transition_time) if admitted and admitted.status == "True" else None
    start, since = deadlines.startup_since(parse_time(p.st.launch_time) or p.now, admitted_at)
    left = deadlines.startup_left(start, rp.startup_deadline_seconds, p.now)
    why = explain_waiting(p.spec, verdict.stuck_reason, verdict.stuck_message)
    if left <= 0:
        p.fail(c.REASON_STARTUP_DEADLINE, f"pods not all running {rp.startup_deadline_seconds}s after "
               f"{since} (runPolicy.startupDeadlineSeconds){': ' + why if why else ''}")
        return True
    if p.st.phase == Phase.PENDING:
        if why:
            if p.reason_changed_to(verdict.stuck_reason):
                p.event("Warning", verdict.stuck_reason, why)
            p.set_phase(Phase.PENDING, verdict.stuck_reason, f"waiting: {why}")
        else:
            p.set_phase(Phase.PENDING, c.REASON_PODS_STARTING, "waiting for every pod to run")
    p.requeue(min(left, STARTING_POLL_S))
    return True
