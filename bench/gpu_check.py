#!/usr/bin/env python
"""`make gpu-check`: the trainer's GPU path, run for real on a machine with CUDA (< 8 minutes).

Checks, each PASS or FAIL with its numbers, the exit code non-zero if any fails:
  train      the tiny model (sftjob_trainer.assets), bf16, on min(2, #GPUs) ranks (NCCL under
             FSDP2 with 2 GPUs): the loss falls; a second run is SIGTERMed mid-way, checkpoints
             (exit 143), reruns and resumes; its losses must equal the uninterrupted run's (GPU
             kernels with atomics are allowed their own run-to-run noise, measured on the steps
             before the stop, nothing more)
  attention  in this process, FSDP2 on a one-rank NCCL group with bf16 mixed precision:
             flash-attention varlen and our per-sequence sdpa on the same packed batch give
             the same loss and gradients within bf16 tolerance (flash-attn must be installed)
  offload    in this process, FSDP2 on a one-rank NCCL group, the 0.5B Qwen2-shaped model, bf16,
             5 AdamW steps on one packed batch with and without trainer.cpu_offload: the losses
             agree (same kernels: within 1e-3) and the peak GPU memory is lower with offload
  liger      the same with and without model.liger_kernel (liger-kernel must be installed):
             losses within bf16 tolerance (other kernels: 2e-2), peak GPU memory not higher
  bench      `make bench-gpu` shortened (bench/bench_gpu.py): tokens/s and MFU of the 0.5B
             Qwen2-shaped model
  image      with docker or buildah and the trainer image present: the image's import check
Without CUDA it prints that nothing was checked and exits 2, unless --allow-no-gpu
(`make gpu-check GPU_CHECK_SKIP=1`).

Usage: python -m bench.gpu_check [--work .bench/gpu-check] [--only train,attention,offload,liger,bench,image]
                                 [--image ghcr.io/sftjob/trainer:0.1.0] [--allow-no-gpu]
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

from bench.bench_gpu import no_cuda_exit

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("train", "attention", "offload", "liger", "bench", "image")


class Failed(Exception):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


# --------------------------------------------------------------------------- train


def trainer_cmd(nproc: int, over: dict) -> list[str]:
    args = [f"{k}={v}" for k, v in over.items()]
    if nproc == 1:
        return [sys.executable, "-m", "sftjob_trainer", *args]
    return [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", f"--nproc-per-node={nproc}", "--", *args]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # a rerun's rows come later and win


def run(cmd: list[str], env: dict, timeout: float = 300, stop_after: int | None = None, out: Path | None = None):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    if stop_after is not None:
        deadline = time.time() + timeout
        while not ((out / "metrics.jsonl").exists() and len(losses(out)) >= stop_after):
            if proc.poll() is not None or time.time() > deadline:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=timeout)
    return proc.returncode, text


def check_train(args, torch) -> str:
    from sftjob_trainer.assets import make_assets

    assets = args.work / "assets"
    if not (assets / "model" / "config.json").exists():
        make_assets(assets, seed=0, train_rows=2000, val_rows=32)
    nproc = min(2, torch.cuda.device_count())
    steps = 40
    over = {"model.path": assets / "model", "data.train_files": assets / "data" / "train.parquet",
            "data.max_length": 64, "data.train_batch_size": 16, "data.micro_batch_size_per_gpu": 4,
            "data.packing": "true", "optim.lr": 3e-3, "optim.lr_scheduler": "constant",
            "trainer.precision": "bf16", "trainer.total_training_steps": steps, "trainer.log_freq": 10}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
    ref, cut = args.work / "train-ref", args.work / "train-cut"
    for d in (ref, cut):
        shutil.rmtree(d, ignore_errors=True)
    code, text = run(trainer_cmd(nproc, {**over, "trainer.output_dir": ref}), env)
    expect(code == 0, f"reference run exited {code}:\n{text[-3000:]}")
    want = losses(ref)
    first, last = sum(want[s] for s in range(1, 6)) / 5, sum(want[s] for s in range(steps - 4, steps + 1)) / 5
    expect(last < 0.7 * first, f"loss fell only from {first:.3f} to {last:.3f}")

    cut_over = {**over, "trainer.output_dir": cut}
    code, text = run(trainer_cmd(nproc, cut_over), env, stop_after=15, out=cut)
    expect(code == 143, f"SIGTERMed run exited {code}, not 143:\n{text[-3000:]}")
    before = losses(cut)
    stopped = max(before)
    expect(stopped < steps and (cut / "checkpoints" / f"step-{stopped}" / "COMMITTED").exists(),
           f"no committed stop checkpoint at step {stopped}")
    code, text = run(trainer_cmd(nproc, cut_over), env)
    expect(code == 0 and f"step-{stopped}" in text and "resumed from" in text, f"rerun did not resume:\n{text[-3000:]}")
    got = losses(cut)
    expect(sorted(got) == list(range(1, steps + 1)), f"rerun steps {sorted(got)}")
    # Run-to-run noise of this GPU's kernels, from the steps both attempts ran from scratch.
    noise = max(abs(before[s] - want[s]) for s in range(1, stopped + 1))
    resumed = max(abs(got[s] - want[s]) for s in range(stopped + 1, steps + 1))
    expect(resumed <= max(4 * noise, 1e-6 * want[steps]),
           f"resumed losses differ by {resumed:.2e} (run-to-run noise before the stop: {noise:.2e})")
    how = "bit-exact" if resumed == 0 else f"max |Δloss| {resumed:.1e} within run-to-run noise {noise:.1e}"
    return (f"{nproc} rank(s){' NCCL' if nproc > 1 else ''}, bf16: loss {first:.3f} -> {last:.3f}; "
            f"stopped at step {stopped}, resumed {how}")


# --------------------------------------------------------------------------- attention


def check_attention(args, torch) -> str:
    import importlib.util

    from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig
    from sftjob_trainer.data import SampleBuilder, SFTDataset
    from sftjob_trainer.batching import collate
    from sftjob_trainer.dist import World
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model, decoder_layers

    expect(importlib.util.find_spec("flash_attn") is not None, "flash-attn is not installed (the trainer image has it)")
    assets = args.work / "assets"  # made by the train check, or here
    if not (assets / "model" / "config.json").exists():
        from sftjob_trainer.assets import make_assets

        make_assets(assets, seed=0, train_rows=2000, val_rows=32)
    device, dist = _one_rank_group(torch, args)
    from transformers import AutoTokenizer

    path = str(assets / "model")
    tok = AutoTokenizer.from_pretrained(path)
    f = str(assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], messages_key="messages", max_length=256)), "c")
    mb = collate([ds.sample(i) for i in range(16)], list(range(16)), packing=True, pad_id=tok.pad_token_id)
    results = {}
    try:
        for attn in ("flash_attention_2", "sdpa_varlen"):
            torch.manual_seed(0)
            cfg = ModelConfig(path=path).model_copy(update={"attn_implementation": attn})
            model = build_model(cfg, LoraConfig(), path, World(0, 0, 1, device), precision="bf16")
            expect(model.config._attn_implementation == attn,
                   f"asked for {attn}, got {model.config._attn_implementation}")
            seen = []
            q_proj = decoder_layers(model)[0].self_attn.q_proj
            q_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))  # noqa: B023 - this iteration's forward
            ce = ce_sum(model, mb, device, "bf16")
            ce.backward()
            expect(seen == [torch.bfloat16], f"{attn}: the forward saw {seen} weights, not bf16 (mixed precision)")
            grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
            results[attn] = (ce.item() / mb.n_targets, grads)
    finally:
        dist.destroy_process_group()
    (fl, fg), (sl, sg) = results["flash_attention_2"], results["sdpa_varlen"]
    expect(abs(fl - sl) <= 1e-2 * abs(sl), f"loss flash {fl:.5f} vs sdpa {sl:.5f}")
    worst = max(((fg[n] - sg[n]).norm() / sg[n].norm().clamp_min(1e-12)).item() for n in sg)
    expect(worst < 0.05, f"gradients differ by {worst:.3f} (relative norm) between flash and sdpa")
    return (f"{len(mb.seq_lengths)} sequences in one packed row ({mb.n_tokens} tokens): loss flash {fl:.5f} "
            f"vs sdpa {sl:.5f}; worst gradient rel. diff {worst:.4f}; FSDP2 gathered bf16 over NCCL")


# --------------------------------------------------------------------------- offload, liger


def few_steps(torch, path: Path, device, steps: int = 5, **options) -> tuple[list[float], float]:
    """Losses of ``steps`` AdamW steps on one fixed packed batch, and the peak GPU memory (GiB),
    for the model built with ``options`` (offload=..., liger=...), on an initialised one-rank group."""
    from sftjob_contract.config import LoraConfig, ModelConfig, OptimConfig
    from sftjob_trainer.batching import MicroBatch
    from sftjob_trainer.dist import World
    from sftjob_trainer.errors import InvalidConfig
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model, check_device_options
    from sftjob_trainer.optim import build_optimizer

    offload, liger = options.get("offload", False), options.get("liger", False)
    try:
        check_device_options(liger, offload, device)
    except InvalidConfig as err:  # e.g. liger-kernel missing from this environment
        raise Failed(str(err)) from None
    torch.manual_seed(0)
    lengths = [1024, 2048, 512, 512]
    ids = torch.randint(3, 5000, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    mb = MicroBatch(ids, targets, positions, None, [0], sum(lengths), sum(lengths) - 1, lengths)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = ModelConfig(path=str(path), liger_kernel=liger)
    model = build_model(cfg, LoraConfig(), str(path), World(0, 0, 1, device), precision="bf16", offload=offload)
    opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-4), fused=False)
    out = []
    for _ in range(steps):
        ce = ce_sum(model, mb, device, "bf16")
        (ce / mb.n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(ce.item() / mb.n_targets)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    return out, peak


def _one_rank_group(torch, args):
    import torch.distributed as dist

    from sftjob_trainer.dist import backend_for

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pg_file = args.work / "pg"
    pg_file.unlink(missing_ok=True)
    dist.init_process_group(backend_for(device), init_method=f"file://{pg_file}", rank=0, world_size=1,
                            device_id=device)
    return device, dist


def _compare(torch, args, option: str, rtol: float, lower: bool) -> str:
    from bench.bench_gpu import prepare

    _, path = prepare(args.work / "bench-gpu", 2000)
    device, dist = _one_rank_group(torch, args)
    try:
        base, base_peak = few_steps(torch, path, device)
        got, peak = few_steps(torch, path, device, **{option: True})
    finally:
        dist.destroy_process_group()
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, base))
    expect(worst <= rtol, f"losses with {option} {got} vs without {base}: {worst:.1e} apart (> {rtol:g})")
    expect(peak < base_peak if lower else peak <= base_peak * 1.02,
           f"peak GPU memory {peak:.2f} GiB with {option}, {base_peak:.2f} GiB without")
    return (f"losses {base[0]:.4f} -> {base[-1]:.4f} without, {got[0]:.4f} -> {got[-1]:.4f} with {option} "
            f"(max rel. diff {worst:.1e}); peak GPU memory {base_peak:.2f} -> {peak:.2f} GiB")


def check_offload(args, torch) -> str:
    return _compare(torch, args, "offload", rtol=1e-3, lower=True)


def check_liger(args, torch) -> str:
    return _compare(torch, args, "liger", rtol=2e-2, lower=False)


# --------------------------------------------------------------------------- bench, image


def check_bench(args, torch) -> str:
    cmd = [sys.executable, "-m", "bench.bench_gpu", "--steps", "10", "--warmup", "3",
           "--work", str(args.work / "bench-gpu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=ROOT)
    text = proc.stdout + proc.stderr
    expect(proc.returncode == 0, f"bench_gpu.py exited {proc.returncode}:\n{text[-3000:]}")
    return " | ".join(line for line in proc.stdout.splitlines() if line.strip())


def check_image(args, torch) -> str:
    probe = "import sftjob_trainer.launch, flash_attn, torch; print(torch.__version__, flash_attn.__version__)"
    if shutil.which("docker"):
        if subprocess.run(["docker", "image", "inspect", args.image], capture_output=True).returncode:
            return (f"SKIPPED: image {args.image} is not on this machine "
                    f"(docker build -f images/trainer/Dockerfile -t {args.image} .)")
        cmd = ["docker", "run", "--rm", "--entrypoint", "python", args.image, "-c", probe]
    elif shutil.which("buildah"):
        made = subprocess.run(["buildah", "from", args.image], capture_output=True, text=True)
        if made.returncode:
            return f"SKIPPED: buildah cannot use image {args.image}: {made.stderr.strip()[-300:]}"
        cmd = ["buildah", "run", made.stdout.strip(), "--", "python", "-c", probe]
    else:
        return "SKIPPED: neither docker nor buildah is installed"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    expect(proc.returncode == 0, f"import check in {args.image} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return f"{args.image}: torch, flash_attn {proc.stdout.strip()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "gpu-check")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated: " + ",".join(CHECKS))
    ap.add_argument("--image", default=os.environ.get("TRAINER_IMAGE", "ghcr.io/sftjob/trainer:0.1.0"))
    ap.add_argument("--allow-no-gpu", action="store_true", help="exit 0 (not 2) on a machine without CUDA")
    args = ap.parse_args()
    unknown = [c for c in args.only.split(",") if c not in CHECKS]
    if unknown:
        ap.error(f"--only: unknown check(s) {','.join(unknown)}; choose from {','.join(CHECKS)}")
    import torch

    refused = no_cuda_exit("gpu-check", "checked", args.allow_no_gpu, "GPU_CHECK_SKIP=1 / --allow-no-gpu")
    if refused is not None:
        return refused
    args.work.mkdir(parents=True, exist_ok=True)
    t_all, failed = time.time(), []
    for name in args.only.split(","):
        fn = {"train": check_train, "attention": check_attention, "offload": check_offload, "liger": check_liger,
              "bench": check_bench, "image": check_image}[name]
        t0 = time.time()
        try:
            status, detail = "PASS", fn(args, torch)
        except (Failed, subprocess.TimeoutExpired) as err:
            status, detail = "FAIL", str(err)
            failed.append(name)
        print(f"[{status}] {name} ({time.time() - t0:.0f}s): {detail}", flush=True)
    wall = time.time() - t_all
    print(f"gpu-check on {torch.cuda.get_device_name(0)}: {'FAILED ' + ','.join(failed) if failed else 'all passed'} "
          f"in {wall:.0f}s{' (over the 8-minute budget)' if wall > 480 else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
