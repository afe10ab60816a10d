"""Fixtures shared by every tier. Cluster fixtures live in tests/fixtures/cluster.py."""
from __future__ import annotations

import os
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
    from sftjob_trainer.assets import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"), seed=0, train_rows=1000, val_rows=48)


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
