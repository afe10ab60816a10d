"""`make chaos`: one real training job, run once untouched and once under seeded faults.

Flow:
  1. the local cluster (started if needed), the CRD, the chart installed by helm
     (`--set crds.enabled=false`: the CRD is applied from crds/ as the tests do), namespace-
     scoped to the chaos namespace; the tiny assets in MinIO (examples/assets.py);
  2. the reference job (same spec) to Succeeded, without faults;
  3. the faulty job: before each fault, wait for a new COMMITTED checkpoint in S3 (the job
     made progress), then for a seeded random trainer step in the next interval; inject; wait
     for the fault's effect (the restart counted, the operator back, MinIO back);
  4. checks: both Succeeded; final weights bitwise identical; no committed checkpoint lost
     (every restart resumed from the newest checkpoint committed before it, none vanished
     while among the newest `keep`); status.restarts equal to the faults injected, by cause,
     and per fault; at least --min-faults faults of --min-kinds kinds.

Exit status 0 only when every check passes. A JSON summary goes to WORKDIR/summary.json.
This module sequences the run; harness.py holds the plumbing (cluster, chart, manifests),
runner.py the faulty run's loop, faults.py the injectors, report.py the checks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from hack.localcluster.kube import ApiError, wait_for
from hack.localcluster.logtap import LogTap

from .faults import BEYOND_DEADLINE_S, KINDS, OPT_IN, THROTTLING, Fault, Injector
from .harness import (JOBS, REPO, Ctx, delete_jobs, install_operator, make_assets, manifest, say, spec_hash,
                      wait_finished)
from .elastic import run_elastic
from .monitor import Monitor
from .report import rank0_log, report_checkpoints, report_faults, report_restarts, report_weights
from .runner import plan_kinds, rank0_step, run_faulty
from .s3proxy import ThrottlingProxy


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hack.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(os.environ.get("CHAOS_SEED", "1")))
    p.add_argument("--faults", type=int, default=12, help="faults to inject (default 12)")
    p.add_argument("--kinds", default=",".join(k for k in KINDS if k not in OPT_IN),
                   help=f"comma-separated, from {', '.join(KINDS)} (default: all but {', '.join(sorted(OPT_IN))})")
    p.add_argument("--min-faults", type=int, default=None, help="fail below this many faults (default --faults)")
    p.add_argument("--min-kinds", type=int, default=4, help="fail below this many kinds injected (default 4)")
    p.add_argument("--interval", type=int, default=2, help="checkpoint.interval of the job (steps)")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.keep of the job")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps (default: interval x (6 x faults + 4), plus what each node-lost fault "
                        "lets pass at the speed the reference run measured)")
    p.add_argument("--minio-outage", type=float, default=6.0, help="seconds MinIO stays stopped")
    p.add_argument("--throttle-fraction", type=float, default=0.5,
                   help="share of S3 requests answered 503 SlowDown by the s3-throttle faults (default 0.5)")
    p.add_argument("--throttle-seconds", type=float, default=20.0,
                   help="how long s3-throttle-commit throttles uploads (default 20)")
    p.add_argument("--progress-deadline", type=int, default=90,
                   help="the job's runPolicy.progressDeadlineSeconds when operator-down-long may run; the operator "
                        "stays away 30 s longer (default 90)")
    p.add_argument("--s3-proxy-port", type=int, default=9100,
                   help="port of the throttling S3 proxy on the cluster bridge's host address (default 9100)")
    p.add_argument("--namespace", default="sftjob-chaos")
    p.add_argument("--system-namespace", default="sftjob-chaos-system")
    p.add_argument("--release", default="sftjob-chaos")
    p.add_argument("--operator-replicas", type=int, default=0,
                   help="set the chart's replicaCount (default: the chart's)")
    p.add_argument("--progress-timeout", type=float, default=600)
    p.add_argument("--effect-timeout", type=float, default=240)
    p.add_argument("--job-timeout", type=float, default=1800)
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "chaos")
    p.add_argument("--skip-install", action="store_true", help="the release is installed already")
    p.add_argument("--reuse-reference", action="store_true",
                   help="keep a Succeeded reference job of the same spec from an earlier run instead of rerunning it")
    e = p.add_argument_group("the elastic job (nodes 2, minNodes 1) and its node-lost-long fault")
    e.add_argument("--elastic", choices=("on", "off", "only"), default="on",
                   help="run it after the faulty run (on), not at all (off), or alone (only)")
    e.add_argument("--node-away", type=float, default=120.0, help="seconds the lost node stays away (default 120)")
    e.add_argument("--elastic-steps", type=int, default=1000, help="its training steps (default 1000)")
    e.add_argument("--elastic-interval", type=int, default=10, help="its checkpoint.interval (default 10)")
    e.add_argument("--elastic-cooldown", type=int, default=20, help="its resources.resizeCooldownSeconds (default 20)")
    args = p.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        p.error(f"unknown fault kinds {bad}; known: {', '.join(KINDS)}")
    args.min_faults = args.faults if args.min_faults is None else args.min_faults
    # Faults that do not stop training (operator kills, MinIO) let it run on while their
    # effect is awaited: about 3 steps per fault on this machine, so twice the faults in intervals.
    # A fault waits for the harness to see a new committed checkpoint, while the trainer goes
    # on: on a fast machine about 5 intervals pass between faults (seen: steps 5, 15, 24),
    # so 2 per fault let the job finish before the plan did. 6 leave room. A node loss lets
    # far more pass (calibrated_steps).
    args.fixed_steps = bool(args.steps)
    args.base_steps = args.interval * (6 * args.faults + 4)
    args.steps = args.steps or args.base_steps
    args.workdir = args.workdir.resolve()
    return args



# A lost node's pods train on, unsupervised, until the Node turns NotReady (the controller
# manager's grace period, about 20 s here) and the operator restarts the gang: about 25 s of
# training pass during one node-lost fault (90 steps at 3.6 steps/s on a fast 2-core machine,
# where a job of the old length finished before its 12th fault). Budgeted with room.
NODE_LOST_S = 45.0
NODE_LOST_MIN_STEPS = 30  # budgeted before the speed is known: a slow machine needs no rerun
SPEED_GUESS = 2.0         # steps/s assumed for idle time before the reference run measured it


def calibrated_steps(base: int, interval: int, node_losses: int, steps_per_s: float | None,
                     idle_s: float = 0.0) -> int:
    """Training steps for a fault plan: BASE plus, per node-lost fault, the steps that pass
    while the lost node turns NotReady (NODE_LOST_S at the measured speed, at least
    NODE_LOST_MIN_STEPS), plus the steps that pass in IDLE_S seconds of faults the job
    trains through (an operator away, throttling windows; at SPEED_GUESS before the speed is
    measured), rounded up to whole checkpoint intervals."""
    per_loss = max(NODE_LOST_MIN_STEPS, math.ceil(NODE_LOST_S * (steps_per_s or 0.0)))
    steps = base + node_losses * per_loss + math.ceil(idle_s * (steps_per_s or SPEED_GUESS))
    return -(-steps // interval) * interval


def idle_seconds(plan: list[str], args: argparse.Namespace) -> float:
    """Seconds of the plan's faults during which the job trains on, unwatched by the harness."""
    per_kind = {"operator-down-long": args.progress_deadline + BEYOND_DEADLINE_S,
                "s3-throttle-commit": args.throttle_seconds, "s3-throttle-download": args.throttle_seconds}
    return float(sum(per_kind.get(k, 0.0) for k in plan))


class StepClock:
    """Training speed of a running job, from its rank-0 metrics endpoint read now and then."""

    def __init__(self, ctx: Ctx, name: str):
        self.inj = Injector(ctx.cfg, ctx.kube, ctx.args.namespace, name, ctx.args.system_namespace,
                            ctx.args.release, random.Random(0))
        self.ctx = ctx
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None

    def sample(self) -> None:
        try:
            step = rank0_step(self.ctx, self.inj, None)
        except (ApiError, OSError):
            return
        if step is None or step <= 0:
            return
        now = time.time()
        if self.first is None:
            self.first = (now, step)
        elif step > self.first[1]:
            self.last = (now, step)

    def steps_per_s(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] - self.first[0] < 5.0:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def run_reference(ctx: Ctx, name: str, obj: dict[str, Any]) -> tuple[dict, float | None]:
    """Create the reference job and wait for it; returns it and its training speed (steps/s)."""
    ctx.kube.create(JOBS.format(ns=ctx.args.namespace), obj)
    clock = StepClock(ctx, name)

    def finished():
        clock.sample()
        job = ctx.get_job(name)
        return job if job and (job.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    job = wait_for(finished, ctx.args.job_timeout, f"{name} to finish", interval=1.0)
    return job, clock.steps_per_s()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rng = random.Random(args.seed)
    summary: dict[str, Any] = {"seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()}}
    ctx = Ctx(args)
    # the plan is drawn first (the faulty run gets it): its node losses set the job's length
    plan = plan_kinds(rng, args.kinds, args.faults)
    node_losses, idle_s = plan.count("node-lost"), idle_seconds(plan, args)
    if THROTTLING & set(args.kinds):   # the jobs reach S3 through the proxy from the start
        ctx.proxy = ThrottlingProxy(ctx.cfg.s3_endpoint, (ctx.cfg.host_ip, args.s3_proxy_port), seed=args.seed)
        ctx.proxy.start()
        args.s3_endpoint = ctx.proxy.endpoint
        say(f"S3 through the throttling proxy {ctx.proxy.endpoint} (to {ctx.cfg.s3_endpoint})")
    if not args.fixed_steps:
        args.steps = calibrated_steps(args.steps, args.interval, node_losses, None, idle_s)
    if not args.skip_install:
        install_operator(ctx)
    make_assets(ctx)
    if args.elastic == "only":
        return finish_elastic(args, run_elastic(ctx), t0)
    ref_name, run_name = f"chaos-ref-{args.seed}", f"chaos-run-{args.seed}"
    ref_obj = manifest(args, ref_name)
    old = ctx.get_job(ref_name) if args.reuse_reference else None
    old_steps = ((old or {}).get("spec", {}).get("training") or {}).get("totalTrainingSteps") or 0
    if old and not args.fixed_steps and old_steps > args.steps:   # a run that calibrated its length
        args.steps = old_steps
        ref_obj = manifest(args, ref_name)
    reuse = bool(old and (old.get("status") or {}).get("phase") == "Succeeded" and
                 old["metadata"].get("labels", {}).get("sftjob.io/chaos-spec") == spec_hash(ref_obj))
    delete_jobs(ctx, keep=ref_name if reuse else None)

    # -- the reference run ----------------------------------------------------------------
    t = time.time()
    speed = None
    if reuse:
        ref = old
        say(f"reference job {args.namespace}/{ref_name}: reusing the earlier run of the same spec (--reuse-reference)")
    else:
        say(f"reference job {args.namespace}/{ref_name}: {args.steps} steps, checkpoint every {args.interval}, "
            f"keep {args.keep}, S3 output; no faults")
        ref, speed = run_reference(ctx, ref_name, ref_obj)
        need = calibrated_steps(args.base_steps, args.interval, node_losses, speed, idle_s)
        if not args.fixed_steps and need > args.steps and ref["status"].get("phase") == "Succeeded":
            say(f"reference: {speed:.1f} steps/s, so the plan's {node_losses} node loss(es) would let the job "
                f"finish before its last fault; again with {need} steps")
            args.steps = need
            delete_jobs(ctx)
            t = time.time()
            ref_obj = manifest(args, ref_name)
            ref, speed = run_reference(ctx, ref_name, ref_obj)
    say(f"reference: {ref['status']['phase']} in {time.time() - t:.0f}s, restarts {ref['status'].get('restarts')}")
    summary["reference"] = {"phase": ref["status"]["phase"], "seconds": round(time.time() - t),
                            "restarts": ref["status"].get("restarts"),
                            "uri": (ref["status"].get("output") or {}).get("uri")}

    # -- the faulty run -------------------------------------------------------------------
    say(f"faulty job {args.namespace}/{run_name}: same spec; {args.faults} faults from {', '.join(args.kinds)}")
    # the kubelets forget a pod's log when it is deleted: keep every incarnation's
    ctx.tap = LogTap(ctx.kube, args.namespace, f"sftjob.io/job-name={run_name}", args.workdir / "pod-logs").start()
    log_path = rank0_log(ctx, run_name)
    offset = log_path.stat().st_size if log_path.exists() else 0  # logs of earlier runs stay
    rank_logs = [ctx.tap.path(f"{run_name}-node-{r}", "trainer") for r in range(2)]
    offsets = [p.stat().st_size if p.exists() else 0 for p in rank_logs]
    ctx.kube.create(JOBS.format(ns=args.namespace), manifest(args, run_name))
    mon = Monitor(ctx.kube, ctx.s3, args.namespace, run_name, tuple(ctx.cfg.nodes))
    mon.start()
    t = time.time()
    faults: list[Fault] = []
    error = None
    try:
        faults = run_faulty(ctx, run_name, mon, rng, plan)
        run = wait_finished(ctx, run_name, args.job_timeout)
    except (TimeoutError, ApiError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
        run = ctx.get_job(run_name) or {"status": {}}
    finally:
        time.sleep(1.0)
        mon.poll()
        mon.stop()
    st = run.get("status") or {}
    say(f"faulty run: {st.get('phase')} in {time.time() - t:.0f}s, restarts {st.get('restarts')}")

    # -- checks ---------------------------------------------------------------------------
    problems: list[str] = []
    if error:
        problems.append(error)
    if ref["status"]["phase"] != "Succeeded":
        problems.append(f"the reference job ended {ref['status']['phase']}: {ref['status'].get('message')}")
    if st.get("phase") != "Succeeded":
        problems.append(f"the faulty job ended {st.get('phase')}: {st.get('message')}")
    problems += report_faults(args, faults, mon, st)
    kinds_used = sorted({f.kind for f in faults})
    exp_pre, found = report_restarts(faults, mon, st)
    problems += found
    retries, found = report_checkpoints(ctx, run_name, mon, offset, rank_logs, offsets, faults)
    problems += found
    summary["s3_retries_logged"] = retries
    cmp = report_weights(ctx, args.workdir, ref, st)
    cmp_ok = cmp is not None and cmp.ok
    if cmp is not None:
        summary["weights"] = {"tensors": cmp.tensors, "identical": cmp.identical, "files": cmp.files,
                              "differing": cmp.differing}
    if not cmp_ok:
        problems.append("final weights are not bitwise identical to the reference run's")

    if args.elastic == "on":
        summary["elastic"] = run_elastic(ctx)
        problems += summary["elastic"]["problems"]
    summary.update(
        faults=[{"index": f.index, "kind": f.kind, "step": f.at_step, "target": f.target, "detail": f.detail,
                 "expected": f.expected, "observed": f.observed, "ok": f.ok,
                 "restart_reasons": f.extra.get("restart_reasons")} for f in faults],
        kinds=kinds_used, steps=args.steps, steps_per_s=speed, restarts=st.get("restarts"),
        expected_preemptions=exp_pre,
        committed=sorted(mon.committed), attempts=[vars(x) for x in mon.attempts], phase=st.get("phase"),
        problems=problems, ok=not problems, seconds=round(time.time() - t0), weights_identical=cmp_ok)
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print()
    if problems:
        print(f"CHAOS FAILED ({len(faults)} faults of {len(kinds_used)} kinds, {time.time() - t0:.0f}s):")
        for p in problems:
            print("  - " + p)
        return 1
    print(f"CHAOS PASSED: {len(faults)} faults of {len(kinds_used)} kinds ({', '.join(kinds_used)}); job Succeeded; "
          f"final weights bitwise identical; no committed checkpoint lost; restart counters match"
          + ("; the elastic job shrank, grew back and matched its reference" if args.elastic == "on" else "")
          + f" ({time.time() - t0:.0f}s; summary {args.workdir / 'summary.json'})")
    return 0


def finish_elastic(args: argparse.Namespace, out: dict[str, Any], t0: float) -> int:
    """--elastic only: the elastic scenario's summary and exit status."""
    out.update(seed=args.seed, seconds=round(time.time() - t0), ok=not out["problems"])
    (args.workdir / "summary.json").write_text(json.dumps({"elastic": out}, indent=1, default=str) + "\n")
    print()
    if out["problems"]:
        print(f"CHAOS FAILED (elastic, {time.time() - t0:.0f}s):")
        for p in out["problems"]:
            print("  - " + p)
        return 1
    print(f"CHAOS PASSED (elastic): shrank to 1 pod {out.get('shrink_s')}s after the lost node was noticed, grew "
          f"back {out.get('grow_s')}s after it returned; every step on the reference's samples; "
          f"{time.time() - t0:.0f}s; summary {args.workdir / 'summary.json'}")
    return 0
