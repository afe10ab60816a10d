"""Fixtures shared by every tier. Cluster fixtures live in tests/fixtures/cluster.py."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if (ROOT / "tests" / "fixtures" / "cluster.py").exists():
    pytest_plugins = ["tests.fixtures.cluster"]

# Keep torch from oversubscribing the 2 cores when several processes run at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The tiny model, tokenizer and parquet data, made once per test session."""
    from tools.assets import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"), seed=0, train_rows=1000, val_rows=48)


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


def needs_a_build(item: pytest.Item) -> bool:
    """The test needs what `make cluster-prepare` builds: the cluster, or a binary or an image."""
    return ("cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("cluster") is not None
            or item.get_closest_marker("built") is not None)


def pytest_configure(config):
    # Registered here, not in pyproject.toml, whose content keys the trainer image's layers.
    config.addinivalue_line("markers", "gpu: the GPU path on a CUDA machine (tests/gpu); runs only when -m asks "
                            "for gpu (`make gpu-check`), and then fails without CUDA")


def gpu_asked(config) -> bool:
    """`-m` names the gpu marker other than as `not gpu`: only then do the GPU checks run."""
    return re.search(r"(?<!not )\bgpu\b", config.option.markexpr or "") is not None


def pytest_collection_modifyitems(config, items):
    """The GPU checks run only when asked for, and then only where there is CUDA: asked for on
    a machine without it, the session stops with exit status 2, having checked nothing (0 with
    GPU_CHECK_SKIP=1, when skipping was meant), so a CPU machine's silence is never read as a pass.

    The tests that need no build run first. `make test` builds the cluster's binaries and
    images in the background (hack/localcluster `prepare`): on a new machine that takes about
    18 minutes, which the trainer's and the operator's unit tests fill instead of waiting.
    Within each group the order is pytest's."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not gpu_asked(config):
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    elif gpu:
        import torch

        if not torch.cuda.is_available():
            if os.environ.get("GPU_CHECK_SKIP"):
                pytest.exit("gpu-check: SKIPPED on purpose: no CUDA device on this machine, nothing was checked",
                            returncode=0)
            pytest.exit("gpu-check: FAILED: no CUDA device on this machine, nothing was checked "
                        "(GPU_CHECK_SKIP=1 to skip on purpose)", returncode=2)
    items.sort(key=needs_a_build)  # stable: within each group, the collection order
