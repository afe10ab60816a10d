"""Failure policy: what a lost or finished pod means for the gang.

A gang either keeps running, succeeds (every rank exited 0), fails for good, or must be
restarted as a whole. Restarts have two causes counted apart: *preemption* (the pod was
taken away or stopped: eviction, DisruptionTarget, Kueue's TerminationTarget, node loss,
deletion, death by a stop signal (exit 128+N for SIGKILL, SIGTERM, SIGINT, SIGHUP), the
trainer's "Preempted" message), which spends `runPolicy.preemptionLimit`, and *failure*
(the trainer exited 1 or 3..127, was OOM-killed, or crashed on a signal of its own:
SIGSEGV, SIGABRT, SIGBUS, ...), which spends `runPolicy.backoffLimit`. A pod gated by
Kueue waits in its queue.

A deterministic error (exit 2, or the trainer's InvalidConfig/InvalidData message) would
fail the same way on every attempt, so it fails the job at once without spending the
budget: retrying cannot help, and a human has to change the spec or the data.

When one rank is taken away (deleted, evicted, its node lost, SIGTERM, SIGKILL) its peers
lose their collective and exit with a generic error a moment later. Such a generic failure
beside a preemption is the preemption's consequence and is counted as that preemption; a
deterministic failure still wins over everything.

A machine that dies is the hard case: the survivors fail within seconds, while the dead
node's pod still reads Running and its Node Ready until the node controller's grace period
(40-50 s) has passed. So a generic failure beside a peer that still "runs" is judged by the
peer node's heartbeat, its Lease in kube-node-lease, which a live kubelet renews every quarter
of the Lease's duration (`settle_generic_failure`): renewed after the failure, the node is
alive and the failure counts as one; silent for the Lease's whole duration, the node is lost
and the gang restarts as a preemption; in between, the verdict waits. Even beside a live node
the verdict waits ECHO_SETTLE_S from the failure: a SIGKILLed rank's exit reaches its pod's
status after the error it caused in its peer.

A NotReady node restarts the gang of the pods on it, but only the pods bound to it before it
went NotReady (`node_ready_for`): a node lost and restored within seconds gets the next gang's
pods while the operator's reading of it may still say NotReady, and that one loss must not
restart the new gang as well.

Exit codes and the termination message follow docs/trainer-contract.md.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from collections.abc import Iterable

from sftjob_contract import exits

from . import conditions as c
from . import queueing
from .nodes import NodeLease, NodeReadiness
from .phases import POD_FINISHED, PodPhase
from .status import observed_time

MAX_RESTART_BACKOFF_S = 300.0

# Signals that stop a process from outside (the kubelet, a drain, an admin, the kernel's
# OOM killer outside any cgroup limit); any other signal is the process crashing itself.
STOP_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 9: "SIGKILL", 15: "SIGTERM"}
CRASH_SIGNALS = {4: "SIGILL", 5: "SIGTRAP", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 11: "SIGSEGV", 31: "SIGSYS"}
# pod.status.reason values set when the pod itself was taken away, not when it failed.
PREEMPTED_POD_REASONS = {"Evicted", "NodeLost", "Shutdown", "NodeShutdown", "Terminated",
                         "Preempting", "UnexpectedAdmissionError", "NodeAffinity", "OutOfcpu",
                         "OutOfmemory", "OutOfpods"}
# Waiting reasons that mean the pod cannot start until something outside it changes.
IMAGE_WAITING_REASONS = {"ImagePullBackOff", "ErrImagePull", "ErrImageNeverPull", "InvalidImageName"}
STUCK_WAITING_REASONS = IMAGE_WAITING_REASONS | {"CreateContainerConfigError", "CreateContainerError"}


class State(enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    PREEMPTED = "Preempted"
    FAILED = "Failed"


@dataclass(frozen=True)
class PodOutcome:
    """What one pod of the current gang is doing or how it ended."""

    state: State
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    permanent: bool = False   # FAILED only: the same spec and data would fail again


def terminated_state(pod: dict[str, Any]) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term: dict[str, Any] | None = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None


def _waiting(pod: dict[str, Any]) -> tuple[str, str]:
    """Why a container of the pod waits (reason, message), e.g. a missing Secret."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") and waiting["reason"] != "ContainerCreating":
            return waiting["reason"], waiting.get("message", "")
    return "", ""


def _unschedulable(pod: dict[str, Any]) -> tuple[str, str]:
    cond = _condition(pod, "PodScheduled")
    if cond and cond.get("status") == "False" and cond.get("reason"):
        return cond["reason"], cond.get("message", "")
    return "", ""


def _condition(pod: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            found: dict[str, Any] = cond
            return found
    return None


def parse_termination_message(message: str | None) -> tuple[str, str]:
    """Split the trainer's one-line `<Reason>: <message>`; ("", text) when it is not one."""
    text = (message or "").strip()
    line = text.splitlines()[-1] if text else ""
    head, sep, tail = line.partition(": ")
    if sep and head.isidentifier() and head[:1].isupper():
        return head, tail.strip()
    return "", text[-1000:]


def classify_pod(pod: dict[str, Any], node_ready: bool | None = None) -> PodOutcome:
    """Classify one pod of the current gang.

    `node_ready` is the Ready condition of the pod's node when the caller could read it
    (None: unknown, not held against the pod).
    """
    status = pod.get("status") or {}
    phase = status.get("phase", PodPhase.PENDING)
    term = terminated_state(pod)
    exit_code = term.get("exitCode") if term else None
    t_reason, t_message = parse_termination_message(term.get("message") if term else None)

    if phase == PodPhase.SUCCEEDED or (phase == PodPhase.FAILED and exit_code == 0
                                       and not pod["metadata"].get("deletionTimestamp")):
        return PodOutcome(State.SUCCEEDED, exit_code=0)
    disruption = _condition(pod, "DisruptionTarget")
    if disruption and disruption.get("status") == "True":
        return PodOutcome(State.PREEMPTED, disruption.get("reason") or c.REASON_PREEMPTED,
                          disruption.get("message", ""), exit_code)
    # Kueue evicted or preempted the pod's Workload (it sets this, then deletes the pod).
    target = queueing.termination_target(pod)
    if target:
        return PodOutcome(State.PREEMPTED, target.get("reason") or c.REASON_PREEMPTED,
                          f"Kueue: {target.get('message', '')}".rstrip(": "), exit_code)
    if pod["metadata"].get("deletionTimestamp"):
        return PodOutcome(State.PREEMPTED, c.REASON_POD_DELETED, "the pod was deleted", exit_code)
    if status.get("reason") in PREEMPTED_POD_REASONS:
        return PodOutcome(State.PREEMPTED, status["reason"], status.get("message", ""), exit_code)
    if phase == PodPhase.FAILED:
        if t_reason == exits.REASON_PREEMPTED:
            return PodOutcome(State.PREEMPTED, c.REASON_PREEMPTED, t_message, exit_code)
        if t_reason in exits.PERMANENT_REASONS or exit_code == exits.PERMANENT:
            return PodOutcome(State.FAILED, t_reason or c.REASON_INVALID_CONFIG,
                              t_message or "the trainer exited 2: invalid config or data", exit_code, permanent=True)
        if t_reason in exits.FAILURE_REASONS:
            return PodOutcome(State.FAILED, t_reason, t_message, exit_code)
        if term and term.get("reason") == "OOMKilled":
            # Killed by the kernel for exceeding its memory limit: it would happen again.
            return PodOutcome(State.FAILED, "OOMKilled", "the trainer exceeded its memory limit", exit_code)
        if exit_code is not None and exit_code > 128 and (exit_code - 128) not in STOP_SIGNALS:
            sig = exit_code - 128
            return PodOutcome(State.FAILED, c.REASON_CRASHED,
                              f"the trainer crashed on signal {sig} ({CRASH_SIGNALS.get(sig, 'not a stop signal')})",
                              exit_code)
        if exit_code is not None and exit_code >= 128:
            sig = exit_code - 128
            return PodOutcome(State.PREEMPTED, c.REASON_SIGNALLED,
                              f"the trainer was stopped by signal {sig} ({STOP_SIGNALS.get(sig, 'unknown')})",
                              exit_code)
        if exit_code is None:
            return PodOutcome(State.PREEMPTED, status.get("reason") or c.REASON_POD_LOST,
                              status.get("message", "the pod failed without a container exit code"), None)
        return PodOutcome(State.FAILED, t_reason or c.REASON_TRAINING_ERROR,
                          t_message or f"the trainer exited with code {exit_code}", exit_code)
    if node_ready is False:
        return PodOutcome(State.PREEMPTED, c.REASON_NODE_NOT_READY,
                          f"node {pod.get('spec', {}).get('nodeName')} is not ready")
    if phase == PodPhase.RUNNING:
        return PodOutcome(State.RUNNING)
    if queueing.is_queued(pod):
        # Waiting for Kueue to admit the gang: not stuck, and not the pod's fault.
        return PodOutcome(State.PENDING, queueing.REASON_QUEUED,
                          f"gated by {', '.join(queueing.kueue_gates(pod))}")
    reason, message = _waiting(pod)
    if not reason:
        reason, message = _unschedulable(pod)
    return PodOutcome(State.PENDING, reason or status.get("reason") or "", message or status.get("message") or "")


class Verdict(enum.Enum):
    STARTING = "Starting"      # some pods not running yet, none lost
    RUNNING = "Running"        # every rank is running (or already finished with 0)
    SUCCEEDED = "Succeeded"    # every rank exited 0
    FAILED = "Failed"          # a deterministic failure: the job fails without a retry
    RESTART_PREEMPTED = "RestartPreempted"
    RESTART_FAILED = "RestartFailed"


@dataclass(frozen=True)
class GangVerdict:
    verdict: Verdict
    reason: str = ""
    message: str = ""
    stuck_reason: str = ""   # STARTING: why a pod waits (ImagePullBackOff, Unschedulable, ...)
    stuck_message: str = ""  # ... and the kubelet's or scheduler's words for it


def judge_gang(outcomes: dict[int, PodOutcome | None], nodes: int) -> GangVerdict:
    """Judge the current gang from each rank's outcome (None: the rank's pod is gone).

    Precedence (module docstring): a deterministic failure; then a preemption from outside
    (its peers' generic failures are its consequence); then a failure; then any other
    preemption. A missing pod is a preemption from outside.
    """
    ranked = sorted(outcomes.items())
    failed = [(r, o) for r, o in ranked if o and o.state is State.FAILED]
    permanent = [(r, o) for r, o in failed if o.permanent]
    if permanent:
        rank, o = permanent[0]
        return GangVerdict(Verdict.FAILED, o.reason, f"rank {rank}: {o.message}")
    lost = [(r, o) for r, o in ranked if o is None or o.state is State.PREEMPTED]
    lost += [(r, None) for r in range(nodes) if r not in outcomes]
    if failed and not lost:
        rank, o = failed[0]
        return GangVerdict(Verdict.RESTART_FAILED, o.reason, f"rank {rank}: {o.message}")
    if lost:
        rank, gone = lost[0]
        reason = gone.reason if gone else c.REASON_POD_DELETED
        message = f"rank {rank}: {gone.message if gone else 'the pod disappeared'}"
        if failed:
            message += f"; rank {failed[0][0]} then failed ({failed[0][1].reason}), counted with the preemption"
        return GangVerdict(Verdict.RESTART_PREEMPTED, reason, message)
    states = [o.state for o in outcomes.values() if o]
    if all(s is State.SUCCEEDED for s in states):
        return GangVerdict(Verdict.SUCCEEDED)
    if any(s is State.PENDING for s in states):
        waiting = [(r, o) for r, o in ranked if o and o.state is State.PENDING and o.reason]
        stuck = next(((r, o) for r, o in waiting if o.reason in STUCK_WAITING_REASONS), None) or \
            next(iter(waiting), None)
        if stuck is None:
            return GangVerdict(Verdict.STARTING)
        return GangVerdict(Verdict.STARTING, stuck_reason=stuck[1].reason,
                           stuck_message=f"rank {stuck[0]}: {stuck[1].message}" if stuck[1].message else "")
    return GangVerdict(Verdict.RUNNING)


def _bound_at(pod: dict[str, Any]) -> datetime | None:
    cond = _condition(pod, "PodScheduled")
    return observed_time(cond.get("lastTransitionTime")) if cond and cond.get("status") == "True" else None


def node_ready_for(pod: dict[str, Any], node: NodeReadiness | None) -> bool | None:
    """The readiness of POD's node as held against the pod (None: unknown, not held).

    A NotReady reading from before the pod was bound to the node is outdated for it: the
    scheduler binds only to a Ready node, so the node has come back since (a reading cached
    a few seconds, a node restored right after its loss). Bound in a later second than the
    node went NotReady, the pod waits for the next reading instead of restarting its gang.
    """
    if node is None:
        return None
    if node.ready or node.since is None:
        return node.ready
    bound = _bound_at(pod)
    if bound is not None and bound > node.since:
        return None
    return False


# finishedAt has whole seconds: a renewal less than this after it may still predate the failure
LEASE_CLOCK_SLACK_S = 1.0


def _finished_at(pod: dict[str, Any] | None) -> datetime | None:
    term = terminated_state(pod) if pod else None
    return observed_time(term.get("finishedAt")) if term else None


# How long a generic failure beside a running peer waits for that peer's status to show why
# (a SIGKILLed rank's exit 137 can reach its pod after its peer's collective error: make chaos
# counted such a restart as a failure).
ECHO_SETTLE_S = 10.0


def settle_generic_failure(outcomes: dict[int, PodOutcome | None], pods: dict[int, dict[str, Any]],
                           leases: dict[str, NodeLease], now: datetime) -> tuple[dict[int, PodOutcome | None], float]:
    """A generic failure (exit 1..127, not deterministic) beside peers that still run: for
    ECHO_SETTLE_S after it the verdict waits for the peers' own status; and is each such peer's
    node alive? Returns the outcomes with every peer whose node has not renewed its
    Lease for the Lease's whole duration since the failure turned PREEMPTED (its machine is
    gone: the failure was its echo), and how many seconds to wait before the verdict when a
    peer's node has not renewed since the failure yet but may still (0: judge now). A peer whose
    node's Lease is unknown (not read, or RBAC forbids it) is taken as alive."""
    generic = [r for r, o in outcomes.items()
               if o and o.state is State.FAILED and not o.permanent
               and o.exit_code is not None and 0 < o.exit_code < 128]
    times = [t for r in generic if (t := _finished_at(pods.get(r))) is not None]
    if not times:
        return outcomes, 0.0
    failed_at = min(times)
    out, hold = dict(outcomes), 0.0
    for r, o in outcomes.items():
        if not o or o.state is not State.RUNNING:
            continue
        # the peer's own end (SIGKILL, eviction) may reach its pod's status after the failure
        # it caused: give it ECHO_SETTLE_S from the failure to show
        hold = max(hold, ECHO_SETTLE_S - (now - failed_at).total_seconds())
        node = ((pods.get(r) or {}).get("spec") or {}).get("nodeName", "")
        lease = leases.get(node)
        if lease is None:
            continue
        if (lease.renewed - failed_at).total_seconds() > LEASE_CLOCK_SLACK_S:
            continue  # renewed after the failure: the node is alive
        silent = (now - lease.renewed).total_seconds()
        if silent >= lease.duration_s:
            out[r] = PodOutcome(State.PREEMPTED, c.REASON_NODE_LEASE_EXPIRED,
                                f"node {node} has not renewed its Lease for {silent:.0f}s (duration "
                                f"{lease.duration_s:.0f}s): its machine or kubelet is gone")
        else:
            hold = max(hold, lease.duration_s - silent)
    return out, hold


def restart_delay(base_seconds: float, restarts_so_far: int) -> float:
    """Exponential back-off before gang restart number restarts_so_far + 1."""
    if base_seconds <= 0:
        return 0.0
    return min(MAX_RESTART_BACKOFF_S, base_seconds * float(2 ** max(0, restarts_so_far)))


def pods_to_stop(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods that still hold resources (not finished, not already being deleted)."""
    return [
        p for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") not in POD_FINISHED
    ]
