"""`make demo`: the whole system end to end on the local cluster.

    python -m demo.run                  # what `make demo` runs (from the checkout's root)
    DEMO_STEPS=12 python -m demo.run    # a shorter training run

Stages (each printed as it starts, each a module of this package):
  1. cluster:  install what is missing (cluster binaries, Prometheus), start the local cluster,
     `helm upgrade --install` the chart (operator namespace-scoped to the demo namespace),
     start Prometheus scraping the operator and the rank-0 trainer (targets);
  2. assets:   make the tiny model + data, upload them to MinIO, create the credentials Secret;
  3. job:      `kubectl apply -f examples/sftjob.yaml` and follow `kubectl get sft`;
  4. preempt:  after the first committed checkpoint, evict one training pod through the
     Eviction API and show the gang restart and the step it resumed from;
  5. model:    download the exported model from status.output.uri, load it with transformers
     and answer the validation prompts next to the base model (inference);
  6. metrics:  summarise the run from Prometheus' HTTP API and draw the loss curve (plot);
     read the run's TensorBoard event files back from S3 (tensorboard) and say how to open them;
  7. leave the cluster running.

Idempotent: a second run reuses the cluster, upgrades the release, re-creates the job.
A machine-readable summary goes to .demo/summary.json (the test reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from demo import prom as promlib
from demo.assets import stage_assets
from demo.cluster import stage_cluster
from demo.context import REPO, Ctx
from demo.job import job_manifest, stage_job
from demo.metrics import stage_metrics
from demo.model import stage_model
from demo.tensorboard import stage_tensorboard
from demo.ui import Out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m demo.run", description=__doc__.split("\n\n")[0])
    env = os.environ.get
    p.add_argument("--steps", type=int, default=int(env("DEMO_STEPS") or 0),
                   help="totalTrainingSteps override (env DEMO_STEPS; default: the example's)")
    p.add_argument("--namespace", default=env("DEMO_NAMESPACE", "sftjob-demo"), help="where the SFTJob runs")
    p.add_argument("--system-namespace", default=env("DEMO_SYSTEM_NAMESPACE", "sftjob-system"),
                   help="the Helm release's namespace (the operator)")
    p.add_argument("--release", default=env("DEMO_RELEASE", "sftjob"))
    p.add_argument("--job", default="tiny-lora")
    p.add_argument("--workdir", type=Path, default=Path(env("DEMO_DIR", str(REPO / ".demo"))))
    p.add_argument("--prometheus-port", type=int, default=int(env("DEMO_PROMETHEUS_PORT") or promlib.DEFAULT_PORT))
    p.add_argument("--keep-prometheus", action="store_true", default=bool(env("DEMO_KEEP_PROMETHEUS")),
                   help="leave Prometheus running after the demo (pid in WORKDIR/prometheus/prometheus.pid)")
    p.add_argument("--timeout", type=float, default=float(env("DEMO_TIMEOUT") or 1800),
                   help="seconds the SFTJob may take")
    p.add_argument("--summary", type=Path, default=None, help="JSON summary (default WORKDIR/summary.json)")
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.summary = args.summary or args.workdir / "summary.json"
    return args


def _finish(ctx: Ctx) -> None:
    out, args = ctx.out, ctx.args
    out.stage(7, "Done: the cluster keeps running")
    out.say(f"kubectl:    source .cluster/env && kubectl -n {args.namespace} get sft,pods")
    out.say(f"model:      {ctx.summary.get('model_dir')}   loss curve: {args.workdir / 'loss.png'}")
    out.say(f"TensorBoard: tensorboard --logdir {(ctx.summary.get('tensorboard') or {}).get('dir')}")
    if args.keep_prometheus:
        out.say(f"Prometheus: {ctx.prom.url} (pid {ctx.prom.pid()})")
    else:
        out.say(f"Prometheus stopped; its data stays in {ctx.prom.workdir}/data")
    out.say("stop everything with: make cluster-down")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    # The demo's own processes (the model in stage 5, its subprocesses): one thread, no hub.
    for key, value in (("OMP_NUM_THREADS", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    out = Out()
    ctx = Ctx(args, out)
    # Evict after the first committed checkpoint: resuming then skips nothing and repeats nothing.
    ctx.preempt_after = job_manifest(args)[0]["spec"]["checkpoint"]["interval"]
    rc = 1
    try:
        stage_cluster(ctx)
        stage_assets(ctx)
        job = stage_job(ctx)
        stage_model(ctx, job)
        stage_metrics(ctx)
        stage_tensorboard(ctx, job)
        _finish(ctx)
        rc = 0
    except SystemExit as e:
        out.end_line()
        print(f"\ndemo failed: {e}", file=sys.stderr)
        ctx.summary["error"] = str(e)
    finally:
        if ctx.scraper:
            ctx.scraper.stop()
        if ctx.prom and not args.keep_prometheus:
            ctx.prom.stop()
        out.done()
        ctx.summary["timings"] = out.timings
        ctx.summary["ok"] = rc == 0
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(ctx.summary, indent=1, default=str) + "\n")
        print(f"\n(total {out.timings['total']:.0f} s; summary {args.summary})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
