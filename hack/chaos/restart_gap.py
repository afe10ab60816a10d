"""`make restart-gap`: preempt a training SFTJob as a cluster does and break down its restart
gap, from the SIGTERM to the next gang's first training step (issue 23 item 9).

    python -m hack.chaos.restart_gap --model tiny     # the example's LoRA job (~4 min)
    python -m hack.chaos.restart_gap --model large    # a 0.37B-parameter full fine-tune (~10 min)

It installs the chart (as `make chaos` does), starts the job, waits for its first committed
checkpoint and a few steps more, then evicts rank 1's pod through the Eviction API (what a
node drain, the cluster autoscaler or a spot reclaim goes through: the kubelet sends SIGTERM).
The operator restarts the whole gang; the trainers write a stop checkpoint and the new gang
resumes from it. gap.py splits the time into stop, relaunch, schedule, container, model
load, restore and first step; rank 0's log splits two of them further:

| segment | split by rank 0's log |
|---|---|
| stop | until rank 0's SIGTERM (the operator deleting the gang), its stop checkpoint committed, the pods gone |
| model load | start-up (interpreter, imports), the model's files downloaded, the model built and sharded |

"large" is a Llama shape (hidden 1024, MLP 4096, 24 layers, 16/4 heads) of 0.37B parameters
with the tiny model's tokenizer, fully fine-tuned in fp32: 4.4 GB of checkpoint (weights and
AdamW moments) and 1.5 GB of base model, on 2 nodes of 1 process (pods of 8 GiB): sized to fit
the local cluster beside its control plane in 24 GB (the ~1B of bench/memory_bench.py trains
here only with the cluster down; sizes between were not tried).
The result goes to WORKDIR/restart-gap-MODEL.json and is printed as a table row.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hack.localcluster.kube import wait_for
from hack.localcluster.logtap import LogTap

from .gap import SEGMENTS, PodClock, breakdown, describe, log_lines, marks
from .harness import EXAMPLE, JOBS, REPO, Ctx, delete_jobs, install_operator, make_assets, say

BUCKET = "sftjob-examples"
LARGE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=4)
LARGE_PREFIX = "models/gap-large"
_SIGTERM = re.compile(r"SIGTERM: will checkpoint")
_STOPPED = re.compile(r"stopped after SIGTERM: checkpoint step-(\d+) committed")
_WRITTEN = re.compile(r"checkpoint step-(\d+) written in ([\d.]+)s")
_COMMITTED = re.compile(r"checkpoint \S+/step-(\d+) committed")
_DOWNLOADED = re.compile(r"downloads: downloaded (\d+) bytes in (\d+) files from (s3://\S+) to \S+ \(([\d.]+)s\)")
_STEP = re.compile(r"sftjob_trainer\.train: step (\d+)/\d+ ")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hack.chaos.restart_gap", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "large"), default="tiny")
    p.add_argument("--steps-after-commit", type=int, default=2,
                   help="steps trained past the first committed checkpoint before the eviction (default 2)")
    p.add_argument("--namespace", default="sftjob-gap")
    p.add_argument("--system-namespace", default="sftjob-gap-system")
    p.add_argument("--release", default="sftjob-gap")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for each wait (default 1200)")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "restart-gap")
    p.add_argument("--skip-install", action="store_true", help="the release is installed already")
    args = p.parse_args(argv)
    args.operator_replicas = 0
    args.workdir = args.workdir.resolve()
    return args


def large_model(root: Path) -> Path:
    """The 0.37B model under root/gap-large, made once (random weights: the gap does not care)."""
    out = root / "gap-large"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(root / "tiny" / "model")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=False,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, **LARGE))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def upload_large(ctx: Ctx) -> None:
    from sftjob_trainer.storage import S3Prefix

    os.environ.update({k: v for k, v in ctx.env.items() if k.startswith("AWS_")})   # MinIO's endpoint and keys
    store = S3Prefix(f"s3://{BUCKET}")
    have = store.list(LARGE_PREFIX)
    local = large_model(REPO / ".assets")
    if sorted(have) != sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()):
        store.upload_dir(local, LARGE_PREFIX)
    say(f"s3://{BUCKET}/{LARGE_PREFIX}: {sum(p.stat().st_size for p in local.rglob('*') if p.is_file()) / 1e9:.2f} GB")


def gap_manifest(model: str, name: str) -> dict[str, Any]:
    """The example job, long enough to be preempted mid-run; "large" is a full fine-tune of
    the 0.37B model with room for its stop checkpoint."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name}
    spec = obj["spec"]
    spec["data"]["valFiles"] = []
    spec["training"]["testFreq"] = 0
    spec["runPolicy"]["ttlSecondsAfterFinished"] = 600
    if model == "tiny":
        spec["training"]["totalTrainingSteps"] = 400
        spec["checkpoint"] = {"interval": 10, "keep": 2}
        return obj
    spec["model"]["path"] = f"s3://{BUCKET}/{LARGE_PREFIX}"
    spec["data"].update(trainBatchSize=4, microBatchSizePerGpu=2)
    spec["training"] = {"totalTrainingSteps": 60, "testFreq": 0,
                        "optim": {"lr": 1e-5, "lrScheduler": "constant"}, "lora": {"rank": 0}}
    spec["resources"]["memory"] = "8Gi"
    spec["checkpoint"] = {"interval": 3, "keep": 1}
    spec["output"] = {"mergeLora": False}
    spec["runPolicy"]["terminationGracePeriodSeconds"] = 600
    return obj


def first(lines: list[tuple[float, str]], pattern: re.Pattern) -> tuple[float, re.Match] | None:
    return next(((t, m) for t, line in lines if (m := pattern.search(line))), None)


def details(at: dict[str, float | None], log: Path, model_uri: str) -> dict[str, float | None]:
    """The stop and the model load split by rank 0's log lines (seconds; absent where a line is missing)."""
    begin, stop_end, container, loaded = at.get("begin"), at.get("stop"), at.get("container"), at.get("model load")
    out: dict[str, float | None] = {}
    if begin and stop_end:
        # The eviction's SIGTERM reaches rank 1 first, rank 0 when the operator deletes the gang.
        old = log_lines(log, begin, stop_end)
        sig, stopped = first(old, _SIGTERM), first(old, _STOPPED)
        if sig:
            out["until rank 0's SIGTERM"] = round(sig[0] - begin, 1)
        if sig and stopped:
            out["rank 0's stop checkpoint committed"] = round(stopped[0] - sig[0], 1)
            out["then pods gone"] = round(stop_end - stopped[0], 1)
            out["stop checkpoint step"] = int(stopped[1].group(1))
        if (written := first(old, _WRITTEN)):
            out["stop checkpoint written in"] = float(written[1].group(2))
    if container and loaded:
        new = log_lines(log, container, loaded)
        if new:
            out["start-up (imports, fence)"] = round(new[0][0] - container, 1)
        got = next((m for _, line in new if (m := _DOWNLOADED.search(line)) and m.group(3) == model_uri), None)
        out["model download"] = float(got.group(4)) if got else 0.0
        out["model MB downloaded"] = round(int(got.group(1)) / 1e6, 1) if got else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args)
    if not args.skip_install:
        install_operator(ctx)
    make_assets(ctx)
    if args.model == "large":
        upload_large(ctx)
    name = f"gap-{args.model}"
    delete_jobs(ctx)
    tap = LogTap(ctx.kube, args.namespace, f"sftjob.io/job-name={name}", args.workdir / f"logs-{time.time():.0f}",
                 timestamps=True).start()
    clock = PodClock(ctx.kube, args.namespace, name)
    clock.start()
    log = tap.path(f"{name}-node-0", "trainer")
    ctx.kube.create(JOBS.format(ns=args.namespace), gap_manifest(args.model, name))
    t0 = time.time()
    say(f"job {args.namespace}/{name} ({args.model}) created; waiting for a committed checkpoint")

    def progress() -> tuple[int, int]:
        lines = log_lines(log, 0)
        ckpt = max((int(m.group(1)) for _, line in lines if (m := _COMMITTED.search(line))), default=0)
        step = max((int(m.group(1)) for _, line in lines if (m := _STEP.search(line))), default=0)
        return ckpt, step

    try:
        wait_for(lambda: (p := progress())[0] and p[1] >= p[0] + args.steps_after_commit, args.timeout,
                 "a committed checkpoint and steps after it", interval=1)
        ckpt, step = progress()
        victim = f"{name}-node-1"
        before = ctx.kube.get(f"/api/v1/namespaces/{args.namespace}/pods/{victim}")["metadata"]["labels"]
        attempt = str(int(before["sftjob.io/attempt"]) + 1)   # the gang after the eviction
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": victim, "namespace": args.namespace}}
        ctx.kubectl("create", "--raw", f"/api/v1/namespaces/{args.namespace}/pods/{victim}/eviction", "-f", "-",
                    input=json.dumps(body))
        say(f"evicted {victim} at step {step} ({time.time() - t0:.0f}s in; checkpoint step-{ckpt} committed)")
        wait_for(lambda: (a := marks(clock.pods, attempt, log)) and a.get("first step"), args.timeout,
                 "the new gang's first step", interval=1)
        time.sleep(1)
    finally:   # a failed wait leaves no job training on behind it
        clock.stop()
        tap.stop()
        ctx.kube.delete(f"{JOBS.format(ns=args.namespace)}/{name}")
    at = marks(clock.pods, attempt, log)
    gap = breakdown(clock.pods, attempt, log)
    more = details(at, log, gap_manifest(args.model, name)["spec"]["model"]["path"])
    result = {"model": args.model, "evicted_at_step": step, "checkpoint_before": ckpt, "gap": gap, "details": more}
    (args.workdir / f"restart-gap-{args.model}.json").write_text(json.dumps(result, indent=1) + "\n")
    say(f"restart gap ({args.model}): {describe(gap)}")
    say("  " + ", ".join(f"{k} {v}" for k, v in more.items()))
    cells = [f"{gap[s]:.1f} s" if gap.get(s) is not None else "?" for s in SEGMENTS]
    total = f"{gap['total']:.1f} s" if gap.get("total") is not None else "?"
    print(f"| {args.model} | " + " | ".join(cells) + f" | {total} |")
    return 0 if gap.get("total") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
