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


def needs_a_build(item: pytest.Item) -> bool:
    """The test needs what `make cluster-prepare` builds: the cluster, or a binary or an image."""
    return ("cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("cluster") is not None
            or item.get_closest_marker("built") is not None)


def pytest_collection_modifyitems(config, items):
    """The tests that need no build run first. `make test` builds the cluster's binaries and
    images in the background (hack/localcluster `prepare`): on a new machine that takes about
    18 minutes, which the trainer's and the operator's unit tests fill instead of waiting.
    Within each group the order is pytest's."""
    items.sort(key=needs_a_build)  # stable: within each group, the collection order
