"""Checkpoint cost and SIGTERM-to-exit time of the real trainer, local and on S3.

    python bench/checkpoint_bench.py [--params 500] [--s3 s3://bucket/prefix]

Builds a random Llama-shaped model of about ``--params`` million parameters (saved with
save_pretrained, loaded by the trainer like any user model), fine-tunes it fully for a few
steps on the tiny assets with a checkpoint every step, and reports from the trainer's own
log: the blocking part of each save (training waits: the copy of the shards to host
memory), the total until the checkpoint is committed (shards written, uploaded for s3://),
and the time from SIGTERM to the process exit (stop checkpoint included).
For an s3:// output the AWS_* variables must point at the store (e.g. `source .cluster/env`).
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRITTEN = re.compile(r"checkpoint step-(\d+) written in ([\d.]+)s")
COMMITTED = re.compile(r"checkpoint .*step-(\d+) committed \(\d+ files, ([\d.]+)s after the save\)")


def make_model(out: Path, params_m: int, assets: Path) -> None:
    """The assets' Llama shape (assets.make_model), widened and deepened to ~params_m million."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.assets import make_model as make_llama

    tok = AutoTokenizer.from_pretrained(assets / "model")
    hidden = 1024 if params_m >= 200 else 256
    per_layer = 9 * hidden * hidden  # attention 3h² (2 of 4 heads for K/V) + gated MLP 6h² (intermediate 2h)
    layers = max(1, round(params_m * 1e6 / per_layer))
    make_llama(out, tok, seed=0, hidden=hidden, layers=layers)
    tok.save_pretrained(out)
    n = AutoModelForCausalLM.from_pretrained(out).num_parameters()
    print(f"model: {layers} layers x hidden {hidden}: {n / 1e6:.0f}M parameters")


def run(args: list[str], sigterm_after_step: int | None = None) -> tuple[str, float | None]:
    cmd = [sys.executable, "-m", "sftjob_trainer", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, stop_at = [], None
    for line in proc.stdout:
        lines.append(line)
        if sigterm_after_step and stop_at is None and re.search(rf"step {sigterm_after_step}/", line):
            stop_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
    proc.wait()
    took = time.monotonic() - stop_at if stop_at else None
    return "".join(lines), took


def report(name: str, log: str) -> None:
    written = {int(s): float(t) for s, t in WRITTEN.findall(log)}
    committed = {int(s): float(t) for s, t in COMMITTED.findall(log)}
    for step, blocked in sorted(written.items()):
        total = (f"{blocked + committed[step]:.2f}s (+{committed[step]:.2f}s in the background)"
                 if step in committed else "-")
        print(f"  {name} step-{step}: blocking {blocked:.2f}s, total {total}")


def keep_log(logs: Path | None, name: str, text: str) -> None:
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / name).write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=500, help="model size in millions of parameters")
    ap.add_argument("--s3", help="also write checkpoints to this s3:// prefix")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--logs", type=Path, help="also keep the trainer's logs in this directory")
    a = ap.parse_args()
    from tools.assets import make_assets

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        assets = make_assets(tmp / "assets", train_rows=64, val_rows=8)
        make_model(tmp / "model", a.params, assets)
        base = [f"model.path={tmp / 'model'}", f"data.train_files={assets / 'data' / 'train.parquet'}",
                "data.max_length=32", "data.train_batch_size=2", "data.micro_batch_size_per_gpu=2",
                "optim.lr=1e-5", "trainer.save_freq=1", "trainer.keep_checkpoints=1"]
        outs = [("local", str(tmp / "out"))]
        outs += [("s3", a.s3.rstrip("/") + f"/ckpt-bench-{int(time.time())}")] if a.s3 else []
        for name, out in outs:
            log, _ = run(base + [f"trainer.output_dir={out}", f"trainer.total_training_steps={a.steps}"])
            keep_log(a.logs, f"{name}-saves.log", log)
            report(name, log)
            log, took = run(base + [f"trainer.output_dir={out}-sig", "trainer.total_training_steps=1000",
                                    "trainer.save_freq=0"], sigterm_after_step=2)
            keep_log(a.logs, f"{name}-sigterm.log", log)
            print(f"  {name}: SIGTERM at step 2 -> exit in {took:.2f}s (stop checkpoint included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
