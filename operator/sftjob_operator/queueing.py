"""Kueue (kueue.sigs.k8s.io) through its pod-group integration. Pure; no I/O.

An SFTJob labelled `kueue.x-k8s.io/queue-name: <LocalQueue>` runs each gang attempt as one
Kueue *pod group*: every pod carries the queue label, the group name label and the group's
total count, so Kueue's webhook gates the pods (scheduling gate `kueue.x-k8s.io/admission`)
and admits the whole gang against the ClusterQueue's quota at once, or none of it.

- The group name changes with every attempt (`<job>-<uid8>-a<attempt>`): after a restart
  Kueue sees a new Workload that queues for admission again, never a half-finished old one.
- `kueue.x-k8s.io/retriable-in-group: "false"`: a group whose pods all ended is finished for
  Kueue (quota released, its finalizers removed) instead of waiting for replacement pods;
  replacements are the operator's business, as the next attempt's group.
- Priority: the pods' `priorityClassName` (spec.resources.priorityClassName) is what Kueue
  orders and preempts Workloads by; a `kueue.x-k8s.io/priority-class` label on the SFTJob
  (a WorkloadPriorityClass) is copied to the pods and takes precedence in Kueue.

Why a label and not a spec field: it is the convention of every Kueue-managed workload
(Jobs, JobSets, pods), so `kubectl get sft -l kueue.x-k8s.io/queue-name=team-a` and Kueue's
own tooling and admission policies work unchanged, and GitOps sets a label as easily as a
field. Changing it affects the next gang attempt only.

What the operator reads back is all on its own pods (no Workload access, so no RBAC
beyond pods): the scheduling gates while queued, the removal of the gates at admission, and
the `TerminationTarget` condition Kueue sets on each pod before deleting it when it evicts
or preempts the Workload.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import conditions as c
from .jobpass import STARTING_POLL_S, Gang, Pass
from .phases import Phase
from .status import iso

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
GATE_PREFIX = "kueue.x-k8s.io/"
# Set by Kueue on each pod of a Workload it stops (evicted, preempted, deleted), just before
# it deletes the pod. Reasons: WorkloadEvictedDueTo<cause> (Preempted, PodsReadyTimeout, ...;
# v0.17 on the local cluster: WorkloadEvictedDueToPreempted), WorkloadDeleted, NoMatchingWorkload.
TERMINATION_TARGET = "TerminationTarget"

REASON_QUEUED = "QueuedByKueue"       # pod condition-like reason of a gated pod
ADMITTED = "Admitted"                 # the SFTJob condition type
REASON_WAITING = "Pending"            # Admitted=False: waiting for quota (Kueue's Workload reason)
REASON_ADMITTED = "Admitted"          # Admitted=True: the gang's gates were removed
REASON_NOT_MANAGED = "NotManagedByKueue"  # Admitted=True: Kueue's webhook never gated the pods
MANAGED_LABEL = "kueue.x-k8s.io/managed"  # set by Kueue's pod webhook on pods it manages
MAX_LABEL = 63


def queue_name(meta: dict[str, Any]) -> str | None:
    """The LocalQueue an SFTJob asks for, or None when it is not queued by Kueue."""
    return (meta.get("labels") or {}).get(QUEUE_LABEL) or None


def group_name(name: str, uid: str, attempt: int) -> str:
    """The pod group (and Kueue Workload) name of one gang attempt: a valid label value."""
    suffix = f"-{uid.replace('-', '')[:8]}-a{attempt}"
    return name[: MAX_LABEL - len(suffix)].rstrip("-.") + suffix


def pod_group(meta: dict[str, Any], uid: str, attempt: int, nodes: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that put one attempt's pods into one Kueue pod group; empty
    when the job has no queue label (nothing changes then)."""
    queue = queue_name(meta)
    if not queue:
        return {}, {}
    labels = {QUEUE_LABEL: queue, GROUP_LABEL: group_name(meta["name"], uid, attempt)}
    priority = (meta.get("labels") or {}).get(PRIORITY_CLASS_LABEL)
    if priority:
        labels[PRIORITY_CLASS_LABEL] = priority
    annotations = {TOTAL_COUNT_ANNOTATION: str(nodes), RETRIABLE_ANNOTATION: "false"}
    return labels, annotations


def kueue_gates(pod: dict[str, Any]) -> list[str]:
    """Kueue's scheduling gates still on the pod (admission, topology)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return [g.get("name", "") for g in gates if g.get("name", "").startswith(GATE_PREFIX)]


def is_queued(pod: dict[str, Any]) -> bool:
    """The pod waits for its Workload's admission (not yet scheduled, still gated)."""
    return bool(kueue_gates(pod)) and not (pod.get("spec") or {}).get("nodeName")


def termination_target(pod: dict[str, Any]) -> dict[str, Any] | None:
    """Kueue's `TerminationTarget` condition when it stopped the pod's Workload."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == TERMINATION_TARGET and cond.get("status") == "True":
            target: dict[str, Any] = cond
            return target
    return None


def managed(pod: dict[str, Any]) -> bool:
    """Kueue's webhook took the pod in (it labels, gates and finalizes the pods it manages)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(MANAGED_LABEL) == "true"


def group_of(pod: dict[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL)


def queued_message(queue: str | None, group: str | None, gates: list[str]) -> str:
    where = f"LocalQueue {queue}" if queue else "Kueue"
    return (f"queued in {where}: the gang waits for Kueue to admit its Workload (pod group {group or '?'}) "
            f"against the ClusterQueue's quota; pods gated by {', '.join(gates) or ADMISSION_GATE}. "
            f"Kueue's reason: kubectl get workload {group or ''} -o jsonpath='{{.status.conditions}}'")


@dataclass(frozen=True)
class Admission:
    """The SFTJob's `Admitted` condition for a gang in a Kueue pod group."""

    admitted: bool
    reason: str
    message: str
    queued: bool   # some pod of the gang is still gated


def admission(pods: list[dict[str, Any]]) -> Admission | None:
    """Whether Kueue has admitted the gang of `pods`; None when they form no pod group."""
    group = next((group_of(p) for p in pods if group_of(p)), None)
    if group is None:
        return None
    queue = next((p["metadata"]["labels"].get(QUEUE_LABEL) for p in pods), None)
    if any(is_queued(p) for p in pods):
        gates = sorted({g for p in pods for g in kueue_gates(p)})
        return Admission(False, REASON_WAITING, queued_message(queue, group, gates), queued=True)
    if not any(managed(p) for p in pods):
        return Admission(True, REASON_NOT_MANAGED,
                         f"pod group {group} was never gated by Kueue, so it runs outside any quota: is Kueue's "
                         "pod integration enabled for this namespace (managedJobsNamespaceSelector)?", queued=False)
    return Admission(True, REASON_ADMITTED,
                     f"Kueue admitted pod group {group} (LocalQueue {queue}); its pods are ungated", queued=False)


# -- applied on a reconcile pass (jobpass.Pass), where the policy is stated ------------------

def set_admitted(p: Pass, admitted: bool, reason: str, message: str) -> None:
    """The `Admitted` condition of a job queued by Kueue; its lastTransitionTime to True
    is when the operator saw the gang's gates removed (the startup deadline starts then)."""
    p.st.conditions = c.set_condition(p.st.conditions, ADMITTED, admitted, reason, message, iso(p.now),
                                      p.generation)


def track_admission(p: Pass, current: Gang) -> bool:
    """For a gang in a Kueue pod group: record whether it is admitted. True while any pod of
    the gang is still gated (queued)."""
    found = admission(list(current.values()))
    if found is None:
        return False
    set_admitted(p, found.admitted, found.reason, found.message)
    return found.queued


def while_starting(p: Pass, verdict: object, current: Gang) -> bool:
    # `verdict` is a failure_policy.GangVerdict, unread here (failure_policy imports this module).
    """Gated by Kueue: no startup deadline runs (it starts at admission, since waiting for
    quota held by other teams is not a failure to start), and the job says so. True then."""
    if not p.queued:
        return False
    cond = c.get_condition(p.st.conditions, ADMITTED)
    message = cond.message if cond else "queued by Kueue"
    if p.st.phase == Phase.PENDING:
        if p.reason_changed_to(REASON_QUEUED):
            p.event("Normal", REASON_QUEUED, message)
        p.set_phase(Phase.PENDING, REASON_QUEUED, message)
    p.requeue(STARTING_POLL_S)
    return True
