"""Stage 4: evict one training pod through the Eviction API (as a cluster draining a node
would), show the operator's gang restart, and find where the new gang resumed."""
from __future__ import annotations

import json
import re
import time

from hack import localcluster
from hack.localcluster.kube import ApiError

from demo.context import Ctx, status, wait_for


COMMITTED = re.compile(r"checkpoint \S+/checkpoints/step-(\d+) committed")
STEP = re.compile(r"\bstep (\d+)/\d+ loss ")


def rank0_log_progress(ctx: Ctx) -> tuple[int, int]:
    """(newest committed checkpoint step, last logged step) from rank 0's log, (0, 0) before
    it has any. The log says a checkpoint committed the moment it does, while the status
    learns it from a scrape every few seconds: a short run can end between two scrapes,
    and then there is nothing left to preempt."""
    try:
        text = localcluster.pod_log(ctx.args.namespace, f"{ctx.args.job}-node-0", "trainer", cfg=ctx.cfg)
    except (ApiError, OSError):
        return 0, 0
    ckpt = max((int(m.group(1)) for m in COMMITTED.finditer(text)), default=0)
    step = max((int(m.group(1)) for m in STEP.finditer(text)), default=0)
    return ckpt, step


def preempt(ctx: Ctx, job: dict, seen: tuple[int, int] = (0, 0)) -> dict:
    """Evict node-1 now; returns the facts the summary and the resume check need. `seen`:
    (committed checkpoint, step) from rank 0's log, newer than the status may be."""
    out, a = ctx.out, ctx.args
    st = status(job)
    victim, rank0 = f"{a.job}-node-1", f"{a.job}-node-0"
    progress = st.get("progress") or {}
    ckpt = max(progress.get("lastCheckpointStep") or 0, seen[0])
    at_step = max(progress.get("step") or 0, seen[1])
    ctx.summary.setdefault("pods", {})["trainer"] = ctx.runs_as(a.namespace, rank0)
    out.stage(4, f"Preempting {victim} mid-run (eviction through the API, as a cluster would)")
    uid0 = ctx.kube.get(f"/api/v1/namespaces/{a.namespace}/pods/{rank0}")["metadata"]["uid"]
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim, "namespace": a.namespace}}
    ctx.kubectl("create", "--raw", f"/api/v1/namespaces/{a.namespace}/pods/{victim}/eviction", "-f", "-",
                input=json.dumps(body),
                show=f"kubectl create --raw /api/v1/namespaces/{a.namespace}/pods/{victim}/eviction -f eviction.json")
    out.say(f"evicted at step {at_step} (last committed checkpoint: step {ckpt})")
    # The operator restarts the whole gang: wait for its verdict and show it.
    j = wait_for(lambda: (x := ctx.get_job()) and (status(x).get("restarts") or {}).get("preemptions", 0) >= 1 and x,
                 180, "the operator to count the preemption")
    cond = next((c for c in status(j).get("conditions", []) if c["type"] == "Restarting"), None)
    if cond:
        out.say(f"condition Restarting={cond['status']} reason={cond['reason']}: {cond.get('message', '')}")
    ctx.show_events(last=4)
    return {"pod": victim, "at_step": at_step, "checkpoint_step": ckpt,
            "attempt_before": st.get("attempt", 0), "rank0": rank0, "rank0_uid": uid0, "time": time.time()}


def resumed_line(ctx: Ctx, pre: dict) -> str | None:
    """The "resumed from" line of the re-created rank-0 pod's log (kubectl logs)."""
    ns = ctx.args.namespace
    try:
        uid = ctx.kube.get(f"/api/v1/namespaces/{ns}/pods/{pre['rank0']}")["metadata"]["uid"]
    except ApiError:
        return None
    if uid == pre["rank0_uid"]:
        return None
    return trainer_log_line(ctx, pre["rank0"], "resumed from")


def trainer_log_line(ctx: Ctx, pod: str, marker: str) -> str | None:
    """The first line of the pod's trainer log that holds marker, from the marker on."""
    for line in localcluster.pod_log(ctx.args.namespace, pod, "trainer", cfg=ctx.cfg).splitlines():
        if marker in line:
            return line[line.index(marker):].strip()
    return None
