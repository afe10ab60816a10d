"""The elastic resize policy: at which size a gang starts, and when a job changes size. Pure.

Elasticity here is by checkpoint and reshard, never by in-place rendezvous: a resize stops
the gang gracefully (it first asks for a checkpoint and waits for it, stop_request.py;
SIGTERM's checkpoint is the fallback), and the next gang starts at the new size
from that checkpoint; the trainer reshards the state and keeps the global batch, so the loss
trajectory is the same job's (sizes.py says which sizes can train a job). A resize is
neither a failure nor a preemption: it is counted apart (`status.resizes`), starts at once
(no back-off) and is rate-limited (`resources.resizeCooldownSeconds`) so that a job never
thrashes between sizes.

"Can run now" is decided in two steps, because only the scheduler (or Kueue) knows for sure:
1. **Eligible nodes** (`eligible_nodes`), read when a gang is about to start: Ready, not
   cordoned, every NoSchedule/NoExecute taint tolerated, the pods' nodeSelector matched, and
   allocatable CPU, memory and GPUs at least one pod's request. Other workloads' usage is not
   subtracted (that would need every pod of the cluster); step 2 covers it. A new gang starts
   at the largest allowed size that fits the eligible nodes (the smallest allowed when none fits).
2. **The scheduler's verdict**: a gang that has not all started `SHRINK_AFTER_S` after its
   launch (pods Unschedulable, or a Kueue pod group not admitted for lack of quota) is
   stopped and started one allowed size smaller, down to `minNodes`. It never ran, so
   nothing is lost, and no part of it keeps holding resources.
A running job smaller than it wants grows when the eligible nodes allow a larger size and
the cooldown since the last resize (or the gang's launch) has passed; an edit of
`resources.nodes` below the running size shrinks it at once (a user's edit is not rate-limited).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from . import api, sizes, stop_request
from .failure_policy import GangVerdict
from .jobpass import Gang, Pass
from .phases import Phase
from .rejections import parse_quantity
from .resources import Toleration
from .status import ResizeStatus, iso, parse_time

SHRINK_AFTER_S = 30.0    # a gang that cannot all start for this long steps down one size

REASON_RESIZING = "Resizing"                  # condition reason while the gang changes size
REASON_SHRINK_UNSCHEDULABLE = "NotAllScheduled"
REASON_SHRINK_CAPACITY = "CapacityLost"
REASON_GROW_CAPACITY = "CapacityReturned"
REASON_SPEC_CHANGED = "SpecChanged"
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Resize:
    """A decision to run the job at another size."""

    to: int
    reason: str
    message: str


def is_elastic(spec: api.SFTJobSpec) -> bool:
    return sizes.min_nodes(spec) < spec.resources.nodes


def _tolerated(taint: dict[str, Any], tolerations: list[Toleration]) -> bool:
    for t in tolerations:
        if t.effect and t.effect != taint.get("effect"):
            continue
        if t.operator == "Exists" and (not t.key or t.key == taint.get("key")):
            return True
        if t.operator == "Equal" and t.key == taint.get("key") and (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def _fits(node: dict[str, Any], spec: api.SFTJobSpec) -> bool:
    res = spec.resources
    meta, nspec, nstatus = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    ready = next((c for c in nstatus.get("conditions") or [] if c.get("type") == "Ready"), None)
    if not ready or ready.get("status") != "True" or nspec.get("unschedulable"):
        return False
    for taint in nspec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, res.tolerations or []):
            return False
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (res.node_selector or {}).items()):
        return False
    allocatable = nstatus.get("allocatable") or {}
    wants = {"cpu": str(res.cpu) if res.cpu is not None else None, "memory": res.memory,
             GPU: str(res.gpus_per_node) if res.gpus_per_node else None}
    for name, want in wants.items():
        need = parse_quantity(want) if want else None
        if need is not None and (parse_quantity(str(allocatable.get(name, "0"))) or Decimal(0)) < need:
            return False
    return True


def eligible_nodes(nodes: list[dict[str, Any]], spec: api.SFTJobSpec) -> int:
    """How many nodes could host one pod of the job now (module docstring, step 1)."""
    return sum(1 for n in nodes if _fits(n, spec))


def launch_size(spec: api.SFTJobSpec, eligible: int | None) -> int:
    """The size a new gang of the job starts at. A fixed-size job, or one whose nodes the
    operator may not read (eligible None), starts at the largest allowed size."""
    allowed = sizes.allowed(spec)
    if not allowed:
        return spec.resources.nodes   # trainer_config refuses it, naming the field
    if eligible is None or not is_elastic(spec):
        return allowed[0]
    return sizes.largest_within(spec, eligible) or allowed[-1]


def shrink_decision(spec: api.SFTJobSpec, size: int, launched: datetime, now: datetime,
                    why: str) -> Resize | None:
    """A gang of `size` pods that has not all started since `launched`: step down one size
    once it has waited SHRINK_AFTER_S (module docstring, step 2)."""
    smaller = sizes.next_smaller(spec, size)
    if smaller is None or (now - launched).total_seconds() < SHRINK_AFTER_S:
        return None
    return Resize(smaller, REASON_SHRINK_UNSCHEDULABLE,
                  f"{size} pods could not all start within {SHRINK_AFTER_S:.0f}s ({why}); "
                  f"starting at {smaller} (resources.minNodes {sizes.min_nodes(spec)})")


def resize_decision(spec: api.SFTJobSpec, size: int, eligible: int | None, since: datetime | None,
                    now: datetime, edited: bool = False) -> tuple[Resize | None, float | None]:
    """A gang of `size` pods is training: resize it? Returns the decision and, when a grow
    waits only for the cooldown, the seconds left of it. `edited`: the spec changed since
    the gang was launched (a user raising resources.nodes): a grow then is the edit's, at once."""
    wanted = spec.resources.nodes
    if size > wanted:
        to = sizes.largest_within(spec, wanted) or wanted
        return Resize(to, REASON_SPEC_CHANGED, f"resources.nodes was set to {wanted}: resizing from {size} to "
                      f"{to} at a checkpoint"), None
    if size == wanted:
        return None, None
    if not is_elastic(spec):   # a fixed-size job whose nodes were raised: it restarts at the new size
        return Resize(wanted, REASON_SPEC_CHANGED, f"resources.nodes was set to {wanted}: resizing from {size} "
                      "at a checkpoint"), None
    grow = sizes.largest_within(spec, min(wanted, eligible)) if eligible is not None else None
    if grow is None or grow <= size:
        return None, None
    if edited:
        return Resize(grow, REASON_SPEC_CHANGED, f"resources.nodes was set to {wanted}: growing from {size} to "
                      f"{grow} ({eligible} node(s) can host a pod) at a checkpoint"), None
    cooldown = spec.resources.resize_cooldown_seconds
    left = cooldown - (now - since).total_seconds() if since else 0.0
    if left > 0:
        return None, left
    return Resize(grow, REASON_GROW_CAPACITY, f"{eligible} node(s) can host a pod now: growing from {size} to "
                  f"{grow} of the {wanted} wanted, at a checkpoint"), None


# -- applied on a reconcile pass (jobpass.Pass), where the policy is stated ------------------

def gang_spec(spec: api.SFTJobSpec, size: int) -> api.SFTJobSpec:
    """The spec a gang of `size` pods is built from: the job's, at that size."""
    if size == spec.resources.nodes:
        return spec
    return spec.model_copy(update={"resources": spec.resources.model_copy(update={"nodes": size})})


def on_new_gang(p: Pass) -> None:
    """Decide the size of the attempt about to be launched (once per attempt): a resize
    already chose it, else the eligible nodes do. A gang restarted at another size than the
    last one (a node lost, or back) is a resize too, and says so."""
    st = p.st
    if st.sized_attempt == st.attempt and st.nodes:
        return
    size = launch_size(p.spec, eligible_nodes(p.cluster_nodes, p.spec) if p.cluster_nodes is not None else None)
    if st.nodes and size != st.nodes:
        wanted = p.spec.resources.nodes
        reason = REASON_SHRINK_CAPACITY if size < st.nodes and size < wanted else (
            REASON_GROW_CAPACITY if st.nodes < size else REASON_SPEC_CHANGED)
        count(p, Resize(size, reason, f"restarting at {size} of the {wanted} wanted pods (was {st.nodes}): "
                        f"{'fewer' if size < st.nodes else 'more'} nodes can host a pod now"))
    st.nodes, st.sized_attempt = size, st.attempt


def count(p: Pass, r: Resize) -> None:
    res = p.st.resizes = p.st.resizes or ResizeStatus()
    res.count += 1
    res.last_reason, res.last_message, res.last_from, res.last_to = r.reason, r.message, p.st.nodes, r.to
    res.last_time = iso(p.now)
    p.event("Normal", r.reason, r.message)


def apply(p: Pass, r: Resize, current: Gang) -> None:
    """Resize now: the gang stops gracefully (checkpointed on request, stop_request.py, or on
    SIGTERM) and the next attempt starts at `r.to`, with no back-off and no restart counted."""
    count(p, r)
    p.st.nodes, p.st.attempt = r.to, p.st.attempt + 1
    p.st.sized_attempt, p.st.restart_after = p.st.attempt, None
    p.set_phase(Phase.RESTARTING, REASON_RESIZING, r.message)
    p.stop(list(current.values()), finished_too=True)
    p.requeue(2.0)


def while_starting(p: Pass, verdict: GangVerdict, current: Gang) -> bool:
    """A gang not all started: step down a size once it has waited long enough. True if it did."""
    why = "queued by Kueue" if p.queued else verdict.stuck_reason or "pods pending"
    r = shrink_decision(p.spec, p.size, parse_time(p.st.launch_time) or p.now, p.now, why)
    if r:
        apply(p, r, current)
    return r is not None


def while_running(p: Pass, verdict: GangVerdict, current: Gang) -> bool:
    """A training gang: grow it, or apply an edit of resources.nodes. True if it resized."""
    pr = p.st.progress
    if pr.step is not None and pr.total_steps is not None and pr.step >= pr.total_steps:
        return False   # final validation and export: let it finish
    eligible = eligible_nodes(p.cluster_nodes, p.spec) if p.cluster_nodes is not None else None
    edited = bool(p.generation and p.st.launched_generation and p.generation > p.st.launched_generation)
    r, left = resize_decision(p.spec, p.size, eligible, parse_time(p.st.launch_time), p.now, edited)
    if r and stop_request.ready_to_stop(p, f"resize to {r.to}"):
        apply(p, r, current)
    elif left:
        p.requeue(left)
    return r is not None
