#!/usr/bin/env python
"""Peak RSS per rank of a full fine-tune on 2 CPU ranks, with and without activation checkpointing.

A benchmark, not a test. Builds (once, under --work) a random Llama-shaped model, by default
~1.0B parameters (hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP 5632, the bench's 8192-word
vocabulary, untied), next to the bench tokenizer and data (make_data.py), then runs
`python -m sftjob_trainer.launch --nproc-per-node=2` for a few steps, fp32, packed micro-batches
of --micro sequences (≤512 tokens each), once with `model.gradient_checkpointing=false` and once
with `true`, and prints the largest rank's peak RSS (the trainer's per-step `max_rss_mb`, the
maximum over ranks of each process's ru_maxrss) and tokens/s.

What to expect for N parameters in fp32 on 2 ranks: each rank holds N/2 of parameters,
gradients and AdamW's two moments (16·N/2 bytes: ~8 GB at 1B) plus one layer gathered whole;
rank 0 also reads the full weights once (4·N bytes) before scattering them. Activations come
on top and are what checkpointing removes. So the 1B run needs ~20 GB of free memory in all;
`--layers 4` (≈0.2B) fits a small machine.

Usage: python -m bench.memory_bench [--layers 22] [--steps 3] [--micro 4] [--work .bench/memory]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import DEFAULT_DATA_DIR, load_model_config_dict

ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path, layers: int) -> tuple[Path, Path]:
    data = DEFAULT_DATA_DIR  # the same data as `make bench`
    if not (data / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "bench.make_data", "--out", str(data), "-n", "512"], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
    model = work / f"model-{layers}l"
    if not (model / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = load_model_config_dict()
        cfg.update(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                   num_key_value_heads=4, head_dim=64)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(model)
        for f in (data / "tokenizer").iterdir():
            shutil.copy(f, model / f.name)
    return data, model


def run(model: Path, data: Path, out: Path, ckpt: bool, steps: int, micro: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    over = {"model.path": model, "data.train_files": data / "train.parquet", "data.max_length": 512,
            "data.train_batch_size": 2 * micro, "data.micro_batch_size_per_gpu": micro, "data.packing": "true",
            "data.shuffle": "false", "optim.lr": 1e-5, "trainer.total_training_steps": steps,
            "trainer.output_dir": out, "trainer.save_interval_s": 0, "trainer.log_freq": 1,
            "model.gradient_checkpointing": str(ckpt).lower()}
    cmd = [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", "--nproc-per-node=2", "--",
           *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_ = [r for r in rows if "loss" in r]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out / "hf", ignore_errors=True)
    return {"checkpointing": ckpt, "peak_rss_mib_largest_rank": max(r["max_rss_mb"] for r in steps_),
            "rss_after_step1_mib": steps_[0]["max_rss_mb"], "tokens_per_s_last": steps_[-1]["tokens_per_s"],
            "final_loss": steps_[-1]["loss"], "wall_s": round(time.time() - t0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22, help="22: ~1.0B parameters; 4: ~0.2B")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4, help="sequences per packed micro-batch per rank")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "memory")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data, model = prepare(args.work, args.layers)
    n = json.loads((model / "config.json").read_text())
    results = [run(model, data, args.work / f"run-ckpt{int(c)}", c, args.steps, args.micro) for c in (False, True)]
    print(f"model: {n['num_hidden_layers']} layers, hidden {n['hidden_size']}; 2 CPU ranks, fp32, full fine-tune, "
          f"packed micro-batches of {args.micro} sequences")
    print("| activation checkpointing | peak RSS MiB (largest rank) | tokens/s (last step) | final loss |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r['checkpointing'] else 'off'} | {r['peak_rss_mib_largest_rank']:.0f} "
              f"| {r['tokens_per_s_last']:.0f} | {r['final_loss']:.4f} |")
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
