#!/usr/bin/env python
"""Peak memory of a full fine-tune on 2 CPU ranks, with and without activation checkpointing,
and (--trl) of the same run under TRL's SFTTrainer.

A benchmark, not a test. Builds (once, under --work) a random Llama-shaped model, by default
~1.0B parameters (hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP 5632, the bench's 8192-word
vocabulary, untied), next to the bench tokenizer and data (make_data.py), then runs
`python -m sftjob_trainer.launch --nproc-per-node=2` for a few steps, fp32, packed micro-batches
of --micro sequences (≤512 tokens each), with `model.gradient_checkpointing` off and on. For each
run it reports the largest process's peak RSS (the kernel's VmHWM: what one rank, or one GPU's
worth of host memory, needs) and the peak of the summed RSS of the launcher and every rank
(sampled every 0.2 s: what the node needs). A run ended by SIGKILL is a result, not an error:
"out of memory in step N" when the kernel log (dmesg) says its OOM killer ended one of the run's
processes, "killed by SIGKILL in step N" when it does not or cannot be read.

--trl runs TRL's SFTTrainer (bench/peer_trl.py, padding-free micro-batches of the same --micro
sequences, two accumulated per step: the same sequences per optimizer step as our two ranks) in
one process with two threads, on the same saved model and data, with TRL's gradient
checkpointing off and on.

What to expect for N parameters in fp32 on 2 ranks: each rank holds N/2 of parameters,
gradients and AdamW's two moments (16·N/2 bytes: ~8 GB at 1B) plus one layer gathered whole;
rank 0 also reads the full weights once (4·N bytes) before scattering them, and gathers them
again for the Hugging Face export at the end. Activations come on top, one micro-batch per rank,
and are what checkpointing removes. One process (TRL) holds all 16·N bytes, but one micro-batch's
activations at a time. So the 1B run needs ~22 GB of free memory in all; `--layers 4` (≈0.2B)
fits a small machine.

Usage: python -m bench.memory_bench [--layers 22] [--steps 3] [--micro 4] [--checkpointing off,on] [--trl]
                                    [--work .bench/memory]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import outputs
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


class TreeRss:
    """Samples, every `interval` s, the summed RSS of a process and all its descendants (the
    launcher and every rank): what the node must hold at once. Per-process peaks come from the
    kernel (VmHWM); the sum is sampled, so a spike shorter than `interval` can be missed."""

    def __init__(self, pid: int, interval: float = 0.2):
        import threading

        self.pid, self.interval, self.peak_sum_mib, self.peak_proc_mib = pid, interval, 0.0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0.0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    rss = proc.memory_info().rss / 2**20
                    hwm = _vm_hwm_mib(proc.pid)
                except (psutil.NoSuchProcess, OSError):
                    continue
                total += rss
                self.peak_proc_mib[proc.pid] = max(self.peak_proc_mib.get(proc.pid, 0.0), hwm or rss)
            self.peak_sum_mib = max(self.peak_sum_mib, total)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _vm_hwm_mib(pid: int) -> float | None:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def measure(cmd: list[str], env: dict, what: str) -> tuple[dict, str, bool]:
    """Run `cmd`, sampling its process tree's memory: (memory and wall time, its output, whether it was killed by
    SIGKILL). A SIGKILLed run is a result, not an error: torchrun reports such a rank as exitcode -9, a lone process
    exits with -9. Any other failure ends the benchmark."""
    t0, started = time.time(), time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT) as proc:
        rss = TreeRss(proc.pid)
        out, _ = proc.communicate()
        rss.stop()
    killed = proc.returncode == -9 or "exitcode: -9" in out or "exitcode  : -9" in out
    if proc.returncode and not killed:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{out[-3000:]}")
    fields = {"peak_sum_mib": rss.peak_sum_mib, "largest_process_mib": max(rss.peak_proc_mib.values(), default=0.0),
              "wall_s": round(time.time() - t0)}
    if killed:
        fields["outcome"] = "out of memory" if oom_killed(set(rss.peak_proc_mib), started) else "killed by SIGKILL"
    return fields, out, killed


OOM_KILL = re.compile(r"^\[\s*([\d.]+)\].*Killed process (\d+) ", re.M)


def oom_killed(pids: set[int], since: float) -> bool:
    """Whether the kernel log says its OOM killer ended one of `pids` at or after `since` (a time.monotonic(),
    the clock of dmesg's stamps, so an old kill of a reused pid does not count). False where the log cannot be
    read."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(int(pid) in pids and float(stamp) >= since - 1 for stamp, pid in OOM_KILL.findall(log))


def run_ours(model: Path, data: Path, out: Path, ckpt: bool, steps: int, micro: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    over = {"model.path": model, "data.train_files": data / "train.parquet", "data.max_length": 512,
            "data.train_batch_size": 2 * micro, "data.micro_batch_size_per_gpu": micro, "data.packing": "true",
            "data.shuffle": "false", "optim.lr": 1e-5, "trainer.total_training_steps": steps,
            "trainer.output_dir": out, "trainer.save_interval_s": 0, "trainer.log_freq": 1,
            "model.gradient_checkpointing": str(ckpt).lower()}
    cmd = [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", "--nproc-per-node=2", "--",
           *[f"{k}={v}" for k, v in over.items()]]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    fields, _, killed = measure(cmd, env, "our run")
    done = outputs.step_rows(out)
    outputs.drop_checkpoints_and_exports(out)
    result = {"contender": "ours, 2 ranks (FSDP2)", "checkpointing": ckpt, "micro": micro, **fields,
              # the trainer's own: the largest rank's high-water mark by the last step (before the
              # final save and export)
              "training_peak_mib": max((r["max_rss_mb"] for r in done), default=None)}
    if killed:
        when = f"in step {len(done) + 1}" if len(done) < steps else "after the last step (final save or export)"
        return {**result, "outcome": f"{result['outcome']} {when}"}
    return {**result, "outcome": "ok", "tokens_per_s": done[-1]["tokens_per_s"], "final_loss": done[-1]["loss"]}


def run_trl(model: Path, data: Path, out: Path, ckpt: bool, steps: int, micro: int) -> dict:
    """The same model, data and optimizer step under TRL's SFTTrainer in one process (no FSDP): micro-batches of
    `micro` sequences made padding-free, 2 accumulated per step (ours: 2 ranks × 1), two threads (ours: 2 × 1)."""
    cmd = [sys.executable, "-m", "bench.peer_trl", "--mode", "padfree", "--model-dir", str(model),
           "--data-dir", str(data), "--steps", str(steps), "--warmup-steps", "1", "--global-batch", str(2 * micro),
           "--micro-batch", str(micro), "--lr", "1e-5", "--output-dir", str(out), "--threads", "2",
           *(["--grad-ckpt"] if ckpt else [])]
    fields, output, killed = measure(cmd, dict(os.environ, HF_HUB_OFFLINE="1"), "TRL's run")
    result = {"contender": "TRL SFTTrainer, 1 process", "checkpointing": ckpt, "micro": micro, **fields}
    if killed:
        return result
    last = output.strip().splitlines()[-1]  # tokens_per_s=<float> loss=<float>
    got = dict(kv.split("=") for kv in last.split())
    return {**result, "outcome": "ok", "tokens_per_s": float(got["tokens_per_s"]), "final_loss": float(got["loss"])}


def on_off(text: str) -> list[bool]:
    """`--checkpointing off,on` → [False, True]."""
    words = [w.strip() for w in text.split(",")]
    if not words or any(w not in ("off", "on") for w in words):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of off and on, got {text!r}")
    return [w == "on" for w in words]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22, help="22: ~1.0B parameters; 4: ~0.2B")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4, help="sequences per packed micro-batch per rank")
    ap.add_argument("--checkpointing", type=on_off, default="off,on",
                    help="activation checkpointing settings to run, in order")
    ap.add_argument("--trl", action="store_true", help="also run TRL's SFTTrainer on the same run (one process)")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "memory")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data, model = prepare(args.work, args.layers)
    n = json.loads((model / "config.json").read_text())
    results = []
    for ckpt in args.checkpointing:
        runs = [(run_ours, "run")] + ([(run_trl, "trl")] if args.trl else [])
        for run, name in runs:
            results.append(run(model, data, args.work / f"{name}-ckpt{int(ckpt)}", ckpt, args.steps, args.micro))
            print(json.dumps(results[-1]), flush=True)
    print(f"model: {n['num_hidden_layers']} layers, hidden {n['hidden_size']}; fp32, full fine-tune, AdamW, "
          f"{args.steps} steps of {2 * args.micro} sequences (micro-batches of {args.micro})")
    print("| contender | activation checkpointing | outcome | peak RSS, all processes (sampled) MiB "
          "| largest process MiB | largest rank by the last step MiB | tokens/s (ours: last step; TRL: after step 1) "
          "| final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"
        loss = f"{r['final_loss']:.4f}" if "final_loss" in r else "-"
        train = f"{r['training_peak_mib']:.0f}" if r.get("training_peak_mib") else "-"
        print(f"| {r['contender']} | {'on' if r['checkpointing'] else 'off'} | {r['outcome']} "
              f"| {r['peak_sum_mib']:.0f} | {r['largest_process_mib']:.0f} | {train} | {tps} | {loss} |")
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
