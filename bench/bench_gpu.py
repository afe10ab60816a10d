#!/usr/bin/env python
"""`make bench-gpu`: our trainer on one GPU, a 0.5B Qwen2-shaped random model, bf16.

One short command for a lent GPU machine; elsewhere it says that it measured nothing and exits
2 (so no caller mistakes a CPU machine's silence for a result), or 0 with --allow-no-gpu.
Builds (once, under --work): the bench data (make_data.py) and a random Qwen2-0.5B-shaped
model (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied
embeddings) saved with save_pretrained next to the bench's word-level tokenizer (its ids
are a subset of the vocabulary). Then runs `python -m sftjob_trainer` with bf16 autocast,
packed micro-batches by token budget, flash-attention varlen when flash-attn is installed
(else per-sequence sdpa), and prints tokens/s over the timed window (steps after the
warm-up) and MFU against --peak-tflops (default 790, an H100/H200-class dense bf16 peak).

Usage: python -m bench.bench_gpu [--steps 12] [--warmup 3] [--global-batch 64]
                               [--tokens-per-micro-batch 16384] [--work .bench/gpu] [--allow-no-gpu]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import outputs

ROOT = Path(__file__).resolve().parents[1]

QWEN2_05B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
    max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_act="silu", attention_dropout=0.0, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def prepare(work: Path, examples: int) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    data = work / "data"
    if not (data / "train.parquet").exists():
        subprocess.run([sys.executable, "-m", "bench.make_data", "--out", str(data), "-n", str(examples)],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    model = work / "model"
    if not (model / "config.json").exists():
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).save_pretrained(model)
        for f in (data / "tokenizer").iterdir():
            shutil.copy(f, model / f.name)
    return data, model


def no_cuda_exit(tool: str, what: str, allow: bool, how_to_skip: str) -> int | None:
    """Without CUDA: the exit status (2, loudly; 0 when skipping was asked for); None with it."""
    import torch

    if torch.cuda.is_available():
        return None
    if allow:
        print(f"{tool}: SKIPPED on purpose: no CUDA device on this machine, nothing was {what}")
        return 0
    print(f"{tool}: FAILED: no CUDA device on this machine, nothing was {what} ({how_to_skip} to skip on purpose)",
          file=sys.stderr)
    return 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "gpu")
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 (not 2) on a machine without CUDA")
    args = ap.parse_args()

    import torch

    refused = no_cuda_exit("bench-gpu", "measured", args.allow_no_gpu, "--allow-no-gpu")
    if refused is not None:
        return refused
    assert args.steps * args.global_batch <= args.examples, "not enough examples for the steps asked"
    args.work.mkdir(parents=True, exist_ok=True)
    data, model = prepare(args.work, args.examples)
    out = args.work / "run"
    shutil.rmtree(out, ignore_errors=True)
    over = {
        "model.path": model, "data.train_files": data / "train.parquet", "data.max_length": 512,
        "data.train_batch_size": args.global_batch, "data.micro_batch_size_per_gpu": 1,
        "data.max_tokens_per_micro_batch": args.tokens_per_micro_batch, "data.packing": "true",
        "data.shuffle": "false", "optim.lr": 1e-4, "optim.lr_scheduler": "constant",
        "trainer.total_training_steps": args.steps, "trainer.output_dir": out, "trainer.precision": "bf16",
        "trainer.peak_tflops": args.peak_tflops, "trainer.seed": 0, "trainer.save_freq": 0,
    }
    cmd = [sys.executable, "-m", "sftjob_trainer", *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-4000:] + proc.stderr[-4000:])
        print(f"bench-gpu: our trainer failed (exit {proc.returncode})")
        return 1
    steps = {r["step"]: r for r in outputs.step_rows(out)}
    last = max(steps)
    timed = [steps[s] for s in range(args.warmup + 1, last + 1)]
    seconds = steps[last]["time"] - steps[args.warmup]["time"]
    tokens = sum(r["tokens"] for r in timed)
    flops = sum(r["mfu"] * args.peak_tflops * 1e12 * r["tokens"] / r["tokens_per_s"] for r in timed)
    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa_varlen"
    print(f"device: {torch.cuda.get_device_name(0)}; attention: {attn}; bf16; "
          f"{args.global_batch} sequences/step, ≤{args.tokens_per_micro_batch} tokens/micro-batch")
    print(f"timed steps {args.warmup + 1}..{last}: {tokens} real tokens in {seconds:.2f}s")
    print(f"tokens_per_s={tokens / seconds:.0f} mfu={flops / seconds / (args.peak_tflops * 1e12):.1%} "
          f"(vs {args.peak_tflops:.0f} TFLOP/s) loss={steps[last]['loss']:.4f} "
          f"wall={time.time() - t0:.0f}s")
    outputs.drop_checkpoints_and_exports(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
