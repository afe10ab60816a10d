"""Fixtures of the GPU checks (`make gpu-check`). Which tests run where is decided in
tests/conftest.py: these are deselected unless `-m` asks for `gpu`, and asking for them on a
machine without CUDA stops the session with exit status 2 (0 with GPU_CHECK_SKIP=1).

Work files (the tiny assets, the 0.5B bench model and data, run outputs) persist under
GPU_CHECK_WORK (default .bench/gpu-check) so that a rerun on the same machine skips making them."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def work() -> Path:
    path = Path(os.environ.get("GPU_CHECK_WORK", ROOT / ".bench" / "gpu-check"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def gpu_assets(work: Path) -> Path:
    """The tiny model and data (tools.assets), made once under the work directory."""
    from tools.assets import make_assets

    root = work / "assets"
    if not (root / "data" / "chat_val.parquet").exists():
        make_assets(root, seed=0, train_rows=2000, val_rows=32)
    return root


@pytest.fixture(scope="session")
def bench_model(work: Path) -> Path:
    """The random 0.5B Qwen2-shaped model of `make bench-gpu` (bench/bench_gpu.py)."""
    from bench.bench_gpu import prepare

    return prepare(work / "bench-gpu", 2000)[1]


@pytest.fixture
def one_rank_group(work: Path) -> Iterator[object]:
    """A one-rank NCCL process group on GPU 0 (what FSDP2 needs), torn down after the test;
    yields the device."""
    import torch
    import torch.distributed as dist

    from sftjob_trainer.dist import backend_for

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    pg_file = work / "pg"
    pg_file.unlink(missing_ok=True)
    dist.init_process_group(backend_for(device), init_method=f"file://{pg_file}", rank=0, world_size=1,
                            device_id=device)
    try:
        yield device
    finally:
        dist.destroy_process_group()
