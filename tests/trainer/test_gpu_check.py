"""`make gpu-check` and `make bench-gpu` must fail loudly where there is no GPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the behaviour without CUDA")]


@pytest.mark.parametrize("module", ["bench.gpu_check", "bench.bench_gpu"])
def test_without_cuda_exits_2_unless_told_to_skip(module, tmp_path):
    cmd = [sys.executable, "-m", module, "--work", str(tmp_path)]
    loud = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert loud.returncode == 2 and "FAILED: no CUDA device" in loud.stderr, loud
    skipped = subprocess.run([*cmd, "--allow-no-gpu"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert skipped.returncode == 0 and "SKIPPED on purpose" in skipped.stdout, skipped
    assert not any(tmp_path.iterdir()), "nothing is prepared on a machine that cannot run it"
