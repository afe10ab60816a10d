#!/usr/bin/env python
"""Longest trainable sample and throughput with Ulysses sequence parallelism, 2 CPU ranks.

A benchmark, not a test. Builds (once, under --work) a random Llama-shaped model from
bench/model_config.json (hidden 384, 6 layers, 6 heads / 2 KV heads, 8192 vocab: ~16M
parameters, small enough that activations, not weights, decide the memory) next to the tiny
assets' tokenizer, and parquet data whose every row is one sample of exactly L tokens. Then for
each sequence-parallel size (1 and 2, both on 2 processes: at sp=1 each rank trains a whole
sample, at sp=2 both ranks train every sample, half each) and each length L (doubling from
--start) runs `python -m sftjob_trainer.launch --nproc-per-node=2` for --steps full fine-tuning
steps, fp32, global batch 2, one sample per micro-batch, and reads the peak RSS of the largest
rank (the step rows' max_rss_mb) and the tokens/s of the last step. A length stops the ladder
for its sp when the run fails, exceeds --max-rss-gb per rank or --max-s seconds.

Usage: python -m bench.sp_bench [--start 2048] [--stop 32768] [--steps 2] [--max-rss-gb 6] [--max-s 120]
                                [--work .bench/sp] [--sp 1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import outputs

ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path) -> Path:
    """The model directory (weights, config, tokenizer), made once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.assets import make_tokenizer

    model = work / "model"
    if not (model / "config.json").exists():
        tok = make_tokenizer(model)
        config = json.loads((ROOT / "bench" / "model_config.json").read_text())
        config.update(max_position_embeddings=1 << 17, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(model)
    return model


def write_data(work: Path, length: int) -> Path:
    """Rows of one sample of ``length`` tokens (a 6-word prompt; the response is cut by data.max_length)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tools.assets import FRUITS

    path = work / f"data-{length}.parquet"
    if not path.exists():
        words = (FRUITS * (length // len(FRUITS) + 2))[:length]
        rows = [{"prompt": f"reverse the list : {FRUITS[i]}", "response": " ".join(words[i:] + words[:i])}
                for i in range(8)]
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants."""
    from tests.trainer.runner import process_tree

    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_point(work: Path, model: Path, sp: int, length: int, steps: int, max_s: float) -> dict:
    data = write_data(work, length)
    out = work / f"out-sp{sp}-{length}"
    shutil.rmtree(out, ignore_errors=True)
    args = {"model.path": model, "data.train_files": data, "data.max_length": length, "data.truncation": "right",
            "data.train_batch_size": 2, "data.micro_batch_size_per_gpu": 1, "data.packing": "false",
            "optim.lr": 1e-4, "trainer.output_dir": out, "trainer.total_training_steps": steps,
            "trainer.log_freq": 1, "trainer.sequence_parallel_size": sp, "trainer.save_freq": 0}
    cmd = [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", "--nproc-per-node=2", "--",
           *[f"{k}={v}" for k, v in args.items()]]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        output, _ = proc.communicate(timeout=max_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # torchrun's ranks run in sessions of their own: a timeout must not leave them on
        proc.communicate()
        return {"sp": sp, "length": length, "ok": False, "why": f"over {max_s:.0f}s"}
    rows = outputs.step_rows(out)
    if proc.returncode != 0 or not rows:
        tail = output.strip().splitlines()[-1:] or [""]
        return {"sp": sp, "length": length, "ok": False, "why": f"exit {proc.returncode}: {tail[0][:200]}"}
    return {"sp": sp, "length": length, "ok": True, "rss_mb": max(r["max_rss_mb"] for r in rows),
            "tokens_per_s": rows[-1]["tokens_per_s"], "loss": rows[-1]["loss"], "wall_s": round(time.time() - t0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "sp")
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--stop", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sp", default="1,2")
    ap.add_argument("--max-rss-gb", type=float, default=6.0)
    ap.add_argument("--max-s", type=float, default=120.0)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = prepare(args.work)
    results = []
    for sp in (int(x) for x in args.sp.split(",")):
        length = args.start
        while length <= args.stop:
            r = run_point(args.work, model, sp, length, args.steps, args.max_s)
            results.append(r)
            print(json.dumps(r), flush=True)
            if not r["ok"] or r["rss_mb"] > args.max_rss_gb * 1024:
                break
            length *= 2
    print("| sp | sample tokens | peak RSS per rank (MB) | tokens/s (2 ranks) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['sp']} | {r['length']} | " + (f"{r['rss_mb']:.0f} | {r['tokens_per_s']:.0f} |" if r["ok"]
                                                    else f"failed: {r['why']} | |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
