"""Fixtures of the trainer tests."""
from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group in this process: FSDP2 runs the N-rank code path (test_fsdp.py, test_gather.py)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
