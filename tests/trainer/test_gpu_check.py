"""`make gpu-check` (tests/gpu) and `make bench-gpu` must fail loudly where there is no GPU, and
the GPU checks must stay out of every other run without being counted as skipped."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the behaviour without CUDA")]


def test_bench_gpu_without_cuda_exits_2_unless_told_to_skip(tmp_path):
    cmd = [sys.executable, "-m", "bench.bench_gpu", "--work", str(tmp_path)]
    loud = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loud.returncode == 2 and "FAILED: no CUDA device" in loud.stderr, loud
    skipped = subprocess.run([*cmd, "--allow-no-gpu"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert skipped.returncode == 0 and "SKIPPED on purpose" in skipped.stdout, skipped
    assert not any(tmp_path.iterdir()), "nothing is prepared on a machine that cannot run it"


def test_gpu_check_without_cuda_exits_2_unless_told_to_skip(tmp_path):
    """What `make gpu-check` runs: asked for, the GPU tests stop the session before any runs."""
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider"]
    env = dict(os.environ, GPU_CHECK_WORK=str(tmp_path))
    env.pop("GPU_CHECK_SKIP", None)
    loud = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert loud.returncode == 2 and "FAILED: no CUDA device" in loud.stdout + loud.stderr, loud
    skipped = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**env, "GPU_CHECK_SKIP": "1"})
    assert skipped.returncode == 0 and "SKIPPED on purpose" in skipped.stdout + skipped.stderr, skipped
    assert not any(tmp_path.iterdir()), "nothing is prepared on a machine that cannot run it"


def test_a_run_that_does_not_ask_for_gpu_deselects_the_gpu_checks():
    """`make test` collects tests/ whole: the GPU checks are deselected there (not skipped, not
    run), and they are there to be deselected (a renamed marker would hide them everywhere)."""
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    deselected = re.search(r"(\d+) deselected", plain.stdout)
    assert deselected and int(deselected.group(1)) >= 6 and "::test_" not in plain.stdout, plain.stdout
    listed = subprocess.run([*cmd, "-m", "not unit"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "::test_" not in listed.stdout, listed.stdout
