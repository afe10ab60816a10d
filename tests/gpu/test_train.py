"""The trainer's GPU path end to end: bf16 training on min(2, #GPUs) ranks (NCCL under FSDP2
with 2 GPUs) learns, and a run SIGTERMed mid-way checkpoints (exit 143), reruns and resumes
with the uninterrupted run's losses; `make bench-gpu` shortened; the image's import check."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import outputs
from sftjob_contract import exits, layout

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


def trainer_cmd(nproc: int, over: dict[str, object]) -> list[str]:
    args = [f"{k}={v}" for k, v in over.items()]
    if nproc == 1:
        return [sys.executable, "-m", "sftjob_trainer", *args]
    return [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", f"--nproc-per-node={nproc}", "--", *args]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in outputs.step_rows(out)}  # a rerun's rows come later and win


def run(cmd: list[str], env: dict[str, str], timeout: float = 300, stop_after: int | None = None,
        out: Path | None = None) -> tuple[int, str]:
    """Run ``cmd``; with ``stop_after``, SIGTERM it once ``out`` has that many steps' losses."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    if stop_after is not None and out is not None:
        deadline = time.time() + timeout
        while not ((out / layout.METRICS_FILE).exists() and len(losses(out)) >= stop_after):
            if proc.poll() is not None or time.time() > deadline:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=timeout)
    return proc.returncode, text


def test_bf16_training_learns_and_resumes_after_sigterm_with_the_same_losses(gpu_assets, work):
    import torch

    nproc = min(2, torch.cuda.device_count())
    steps = 40
    over: dict[str, object] = {
        "model.path": gpu_assets / "model", "data.train_files": gpu_assets / "data" / "train.parquet",
        "data.max_length": 64, "data.train_batch_size": 16, "data.micro_batch_size_per_gpu": 4,
        "data.packing": "true", "optim.lr": 3e-3, "optim.lr_scheduler": "constant",
        "trainer.precision": "bf16", "trainer.total_training_steps": steps, "trainer.log_freq": 10}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
    ref, cut = work / "train-ref", work / "train-cut"
    for d in (ref, cut):
        shutil.rmtree(d, ignore_errors=True)
    code, text = run(trainer_cmd(nproc, {**over, "trainer.output_dir": ref}), env)
    assert code == 0, f"reference run exited {code}:\n{text[-3000:]}"
    want = losses(ref)
    first, last = sum(want[s] for s in range(1, 6)) / 5, sum(want[s] for s in range(steps - 4, steps + 1)) / 5
    assert last < 0.7 * first, f"loss fell only from {first:.3f} to {last:.3f}"

    cut_over = {**over, "trainer.output_dir": cut}
    code, text = run(trainer_cmd(nproc, cut_over), env, stop_after=15, out=cut)
    assert code == exits.PREEMPTED, f"SIGTERMed run exited {code}, not {exits.PREEMPTED}:\n{text[-3000:]}"
    before = losses(cut)
    stopped = max(before)
    assert stopped < steps and (cut / layout.checkpoint_dir(stopped) / layout.COMMITTED).exists(), \
        f"no committed stop checkpoint at step {stopped}"
    code, text = run(trainer_cmd(nproc, cut_over), env)
    assert code == 0 and layout.step_dir(stopped) in text and "resumed from" in text, \
        f"rerun did not resume:\n{text[-3000:]}"
    got = losses(cut)
    assert sorted(got) == list(range(1, steps + 1)), f"rerun steps {sorted(got)}"
    # GPU kernels with atomics have run-to-run noise: measured on the steps both attempts ran
    # from scratch, and the resumed steps may differ by that much, nothing more.
    noise = max(abs(before[s] - want[s]) for s in range(1, stopped + 1))
    resumed = max(abs(got[s] - want[s]) for s in range(stopped + 1, steps + 1))
    assert resumed <= max(4 * noise, 1e-6 * want[steps]), \
        f"resumed losses differ by {resumed:.2e} (run-to-run noise before the stop: {noise:.2e})"
    how = "bit-exact" if resumed == 0 else f"max |Δloss| {resumed:.1e} within run-to-run noise {noise:.1e}"
    print(f"{nproc} rank(s){' NCCL' if nproc > 1 else ''}, bf16: loss {first:.3f} -> {last:.3f}; "
          f"stopped at step {stopped}, resumed {how}")


def test_bench_gpu_measures_tokens_per_second_and_mfu(work):
    cmd = [sys.executable, "-m", "bench.bench_gpu", "--steps", "10", "--warmup", "3",
           "--work", str(work / "bench-gpu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=ROOT)
    assert proc.returncode == 0, f"bench_gpu.py exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    assert "tokens_per_s=" in proc.stdout and "mfu=" in proc.stdout, proc.stdout
    print(" | ".join(line for line in proc.stdout.splitlines() if line.strip()))


def test_the_trainer_image_imports_torch_and_flash_attn():
    image = os.environ.get("TRAINER_IMAGE", "ghcr.io/sftjob/trainer:0.1.0")
    probe = "import sftjob_trainer.launch, flash_attn, torch; print(torch.__version__, flash_attn.__version__)"
    if shutil.which("docker"):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            pytest.skip(f"image {image} is not on this machine "
                        f"(docker build -f images/trainer/Dockerfile -t {image} .)")
        cmd = ["docker", "run", "--rm", "--entrypoint", "python", image, "-c", probe]
    elif shutil.which("buildah"):
        made = subprocess.run(["buildah", "from", image], capture_output=True, text=True)
        if made.returncode:
            pytest.skip(f"buildah cannot use image {image}: {made.stderr.strip()[-300:]}")
        cmd = ["buildah", "run", made.stdout.strip(), "--", "python", "-c", probe]
    else:
        pytest.skip("neither docker nor buildah is installed")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"import check in {image} failed:\n{(proc.stdout + proc.stderr)[-2000:]}"
    print(f"{image}: torch, flash_attn {proc.stdout.strip()}")
