"""`make chaos`, part two (issue 25, item 7): an elastic job through a `node-lost-long` fault.

The job (`nodes: 2, minNodes: 1`) trains until it has committed a checkpoint; then the node
under one of its pods is lost as a reclaimed spot machine is (kubelet and containers killed,
the Node turns NotReady) and stays away for --node-away seconds. The job must resume at 1 pod
(`CapacityLost`), train there, and grow back to 2 (`CapacityReturned`) once the node returns;
it must succeed with no failure and 2 resizes. A fixed-size reference run (`minNodes` unset,
so the gang always restarts at 2) of the same spec then runs untouched.

What is compared: everything, bit for bit.
- **Data order.** Every step's sample ids (the trainer logs them) equal the reference's, and
  no epoch repeats a sample: the order is a function of the seed and the step, never of the
  size, so a skipped, repeated or reordered sample fails.
- **Losses and final weights, bitwise.** The global batch and the micro-batches do not change
  with the size, so a step at 1 pod adds the same two micro-batch gradients the all-reduce
  adds at 2 pods, and in the same order. One operation of the step depends on the size: the
  gradient norm, which FSDP computes per shard and combines across ranks, and which rounds
  differently from the norm of the whole tensor in one process. It decides the update only
  through clipping, so these jobs train with `optim.clipGrad: 0`. Measured with clipping on
  (the default 1.0, seed 1): losses bitwise equal through step 173 of 600 although steps
  28-456 ran at 1 pod; at step 172 the norms were 1.3337537 (elastic) and 1.3337536
  (reference), the clip factors differed in the last bit, and at this learning rate the two
  trajectories then drift apart (final loss 1.1e-4 against 5.3e-4). Without clipping nothing
  is left that could differ, so the check is exact.
- **Micro-batches that do not depend on the size.** Packed micro-batches (the trainer's
  default) are filled by tokens within each rank's share of the global batch, so at 1 pod
  the share of 2 regroups into other micro-batches: the same samples and the same loss up to
  rounding, but not the same sums bit for bit. These jobs therefore train padded
  (`data.packing: false`): 128 samples per micro-batch, one per rank at 2 pods, two at 1.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hack import localcluster
from sftjob_contract import layout

from hack.localcluster.kube import wait_for
from hack.localcluster.logtap import LogTap

from .gap import PodClock, breakdown, describe, marks
from .harness import JOBS, Ctx, manifest, say, spec_hash, wait_finished
from .monitor import split_uri
from .report import report_weights

def elastic_manifest(args: argparse.Namespace, name: str, elastic: bool) -> dict[str, Any]:
    obj = manifest(args, name)
    spec = obj["spec"]
    spec["training"].update(totalTrainingSteps=args.elastic_steps, logSampleIds=True)
    spec["training"]["optim"]["clipGrad"] = 0   # the one size-dependent rounding (module docstring)
    spec["data"]["packing"] = False              # micro-batches independent of the size (module docstring)
    spec["checkpoint"] = {"interval": args.elastic_interval, "keep": args.keep}
    if elastic:
        spec["resources"].update(minNodes=1, resizeCooldownSeconds=args.elastic_cooldown)
    obj["metadata"]["labels"]["sftjob.io/chaos-spec"] = spec_hash(obj)
    return obj


def _status(ctx: Ctx, name: str) -> dict:
    return (ctx.get_job(name) or {}).get("status") or {}


def _at(ctx: Ctx, name: str, nodes: int):
    def pred():
        st = _status(ctx, name)
        if st.get("phase") in ("Succeeded", "Failed"):
            raise RuntimeError(f"{name} ended {st.get('phase')} before running at {nodes} pod(s): {st.get('message')}")
        return st if st.get("nodes") == nodes and st.get("phase") == "Running" else None
    return pred


def _delete(ctx: Ctx, *names: str) -> None:
    ns = ctx.args.namespace
    for n in names:
        if ctx.get_job(n):
            ctx.kube.delete(f"{JOBS.format(ns=ns)}/{n}")
    wait_for(lambda: not any(ctx.get_job(n) for n in names), 120, "the earlier elastic chaos jobs to go")
    wait_for(lambda: not [p for p in ctx.kube.get(f"/api/v1/namespaces/{ns}/pods")["items"]
                          if p["metadata"].get("labels", {}).get("sftjob.io/job-name") in names], 180,
             "their pods to go")


def _victim_node(ctx: Ctx, name: str) -> tuple[str, str]:
    """A node under a training pod, preferring one that runs no operator pod (a lost operator
    is `make chaos`'s other faults' business): (node, why)."""
    a = ctx.args
    pods = ctx.kube.get(f"/api/v1/namespaces/{a.namespace}/pods", labelSelector=f"sftjob.io/job-name={name}")["items"]
    nodes = sorted({p["spec"].get("nodeName") for p in pods
                    if (p.get("status") or {}).get("phase") == "Running"} - {None})
    ops = {p["spec"].get("nodeName") for p in ctx.kube.get(
        f"/api/v1/namespaces/{a.system_namespace}/pods",
        labelSelector=f"app.kubernetes.io/instance={a.release}")["items"]}
    free = [n for n in nodes if n not in ops]
    if free:
        return free[-1], "under a training pod, no operator pod on it"
    return nodes[-1], "under a training pod; the operator runs there too"


def steps_logged(ctx: Ctx, st: dict) -> dict[int, dict]:
    """Each step's last record (a redone step: the later attempt's) from the job's metrics.jsonl."""
    bucket, key = split_uri(st["output"]["checkpointsUri"])
    key = key.rsplit("/", 1)[0] + "/" + layout.METRICS_FILE
    body = ctx.s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    rows = [json.loads(line) for line in body.splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "sample_ids" in r}


def compare_runs(run: dict[int, dict], ref: dict[int, dict], steps: int) -> tuple[dict, list[str]]:
    """Sample ids per step exactly, no sample twice in an epoch, every loss bitwise equal."""
    problems = []
    want = list(range(1, steps + 1))
    for label, got in (("elastic", run), ("reference", ref)):
        if sorted(got) != want:
            problems.append(f"the {label} run logged steps {sorted(set(want) - set(got))[:10]} missing")
    common = [s for s in want if s in run and s in ref]
    differ = [s for s in common if run[s]["sample_ids"] != ref[s]["sample_ids"]]
    if differ:
        problems.append(f"{len(differ)} steps trained on other samples than the reference's, first step {differ[0]}: "
                        f"{run[differ[0]]['sample_ids']} vs {ref[differ[0]]['sample_ids']}")
    # An epoch is the whole global batches that fit in the data (the remainder waits for the next).
    n_samples = len({i for r in ref.values() for i in r["sample_ids"]})
    batch = len(ref[1]["sample_ids"]) if 1 in ref else 0
    per_epoch = n_samples // batch if batch else 0
    for first in range(1, steps - per_epoch + 2, per_epoch or 1):
        ids = [i for s in range(first, first + per_epoch) if s in run for i in run[s]["sample_ids"]]
        if per_epoch and not len(ids) == len(set(ids)) == per_epoch * batch:
            problems.append(f"the epoch from step {first} repeated or missed a sample ({len(set(ids))} distinct of "
                            f"{per_epoch * batch})")
            break
    losses = [s for s in common if run[s].get("loss") != ref[s].get("loss")]
    loss_diff = max((abs(run[s]["loss"] - ref[s]["loss"]) for s in losses), default=0.0)
    if losses:
        s = losses[0]
        problems.append(f"{len(losses)} steps' losses differ from the reference's, first step {s}: "
                        f"{run[s]['loss']!r} vs {ref[s]['loss']!r} "
                        f"(grad norm {run[s].get('grad_norm')!r} vs {ref[s].get('grad_norm')!r})")
    return {"steps_compared": len(common), "steps_with_other_samples": len(differ), "samples_per_epoch":
            per_epoch * batch, "steps_with_other_losses": len(losses), "max_loss_diff": loss_diff}, problems


def run_elastic(ctx: Ctx) -> dict[str, Any]:
    """The scenario; returns its summary with `problems` (empty: passed)."""
    a = ctx.args
    name, ref_name = f"chaos-elastic-{a.seed}", f"chaos-elastic-ref-{a.seed}"
    _delete(ctx, name, ref_name)
    out: dict[str, Any] = {"steps": a.elastic_steps, "node_away_s": a.node_away}
    problems: list[str] = []
    say(f"elastic job {a.namespace}/{name}: nodes 2, minNodes 1, {a.elastic_steps} steps, checkpoint every "
        f"{a.elastic_interval}, resize cooldown {a.elastic_cooldown}s; fault node-lost-long ({a.node_away:g}s away)")
    tap = LogTap(ctx.kube, a.namespace, f"sftjob.io/job-name={name}", a.workdir / "elastic-logs",
                 timestamps=True).start()
    clock = PodClock(ctx.kube, a.namespace, name)
    clock.start()
    ctx.kube.create(JOBS.format(ns=a.namespace), elastic_manifest(a, name, elastic=True))
    t0 = time.time()
    wait_for(lambda: (st := _at(ctx, name, 2)()) and (st.get("progress") or {}).get("lastCheckpointStep"),
             a.progress_timeout, "a committed checkpoint at 2 pods", interval=1)
    node, why = _victim_node(ctx, name)
    step0 = (_status(ctx, name).get("progress") or {}).get("step")
    say(f"node-lost-long: {node} ({why}) lost at step {step0}")
    t_lost = time.time()
    localcluster.node_lost(node, cfg=ctx.cfg, kill_containers=True)
    restored = False
    try:
        say(f"  {node} NotReady {time.time() - t_lost:.0f}s after its loss")
        wait_for(lambda: (_status(ctx, name).get("restarts") or {}).get("preemptions", 0) >= 1, a.effect_timeout,
                 "the lost node noticed (a preemption)", interval=0.5)
        t_noticed = out["noticed_at"] = time.time()
        st = wait_for(_at(ctx, name, 1), a.effect_timeout, "running at 1 pod", interval=0.5)
        out["shrink_s"] = round(time.time() - t_noticed, 1)
        out["shrink_reason"] = (st.get("resizes") or {}).get("lastReason")
        step1 = (st.get("progress") or {}).get("step") or 0
        say(f"  running at 1 pod {out['shrink_s']:.0f}s after the operator noticed (reason {out['shrink_reason']}, "
            f"step {step1})")
        while time.time() < t_lost + a.node_away:
            st = _status(ctx, name)
            if st.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(2)
        out["steps_at_1"] = ((st.get("progress") or {}).get("step") or 0) - step1
        if st.get("phase") in ("Succeeded", "Failed"):
            problems.append(f"the job ended {st.get('phase')} while the node was away: raise --elastic-steps")
        localcluster.node_restore(node, cfg=ctx.cfg)
        restored = True
        t_back = time.time()
        say(f"  {node} back after {t_back - t_lost:.0f}s; {out['steps_at_1']} steps trained at 1 pod meanwhile")
        if not problems:
            st = wait_for(_at(ctx, name, 2), a.effect_timeout + a.elastic_cooldown, "grown back to 2 pods",
                          interval=0.5)
            out["grow_s"] = round(time.time() - t_back, 1)
            out["grow_reason"] = (st.get("resizes") or {}).get("lastReason")
            say(f"  at 2 pods again {out['grow_s']:.0f}s after the node returned (reason {out['grow_reason']}, "
                f"step {(st.get('progress') or {}).get('step')})")
    except (TimeoutError, RuntimeError) as e:
        problems.append(str(e))
    finally:
        if not restored:
            localcluster.node_restore(node, cfg=ctx.cfg)
    run = wait_finished(ctx, name, a.job_timeout)
    st = run.get("status") or {}
    clock.stop()
    tap.stop()
    out["gaps"] = {}
    for attempt in sorted({t.attempt for t in clock.pods.values() if t.attempt.isdigit()}, key=int)[1:]:
        gap = breakdown(clock.pods, attempt, tap.path(f"{name}-node-0", "trainer"))
        if gap:
            out["gaps"][attempt] = gap
            size = len({t.name for t in clock.pods.values() if t.attempt == attempt})
            say(f"  restart gap before attempt {attempt} ({size} pod(s)): {describe(gap)}")
            first = marks(clock.pods, attempt, tap.path(f"{name}-node-0", "trainer")).get("first step")
            if size == 1 and first and "noticed_at" in out:   # the acceptance's measure: noticed -> training
                out["first_step_at_1_s"] = round(first - out["noticed_at"], 1)
                say(f"  first step at 1 pod {out['first_step_at_1_s']:.1f}s after the operator noticed the lost node")
    out.update(phase=st.get("phase"), seconds=round(time.time() - t0), restarts=st.get("restarts"),
               resizes=st.get("resizes"))
    say(f"elastic job: {st.get('phase')} in {time.time() - t0:.0f}s, restarts {st.get('restarts')}, "
        f"resizes {(st.get('resizes') or {}).get('count')}")
    if st.get("phase") != "Succeeded":
        problems.append(f"the elastic job ended {st.get('phase')}: {st.get('message')}")
    if (st.get("restarts") or {}).get("failures", 0):
        problems.append(f"the elastic job counted failures: {st.get('restarts')}")
    if (st.get("resizes") or {}).get("count") != 2:
        problems.append(f"the elastic job resized {(st.get('resizes') or {}).get('count')} times, not 2 (down, up)")
    for key, want in (("shrink_reason", "CapacityLost"), ("grow_reason", "CapacityReturned")):
        if key in out and out[key] != want:
            problems.append(f"{key.split('_')[0]} reason {out[key]}, not {want}")

    say(f"elastic reference {a.namespace}/{ref_name}: the same spec at a fixed 2 pods, no faults")
    ref_obj = elastic_manifest(a, ref_name, elastic=False)
    ctx.kube.create(JOBS.format(ns=a.namespace), ref_obj)
    ref_st = wait_finished(ctx, ref_name, a.job_timeout).get("status") or {}
    if ref_st.get("phase") != "Succeeded":
        problems.append(f"the elastic reference ended {ref_st.get('phase')}: {ref_st.get('message')}")
    elif st.get("phase") == "Succeeded":
        data, found = compare_runs(steps_logged(ctx, st), steps_logged(ctx, ref_st), a.elastic_steps)
        problems += found
        say(f"elastic vs reference: {data['steps_compared']} steps, {data['steps_with_other_samples']} on other "
            f"samples, {data['steps_with_other_losses']} with another loss; final weights:")
        cmp = report_weights(ctx, a.workdir / "elastic", {"status": ref_st}, st)
        if cmp is None or not cmp.ok:
            problems.append("the elastic job's final weights are not bitwise identical to the reference's")
        out.update(data=data, weights=cmp and {"tensors": cmp.tensors, "identical": cmp.identical,
                                               "differing": cmp.differing, "files": cmp.files})
    out["problems"] = problems
    return out
