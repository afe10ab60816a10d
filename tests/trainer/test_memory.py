"""Each rank's memory must not grow with the dataset: parquet is streamed by row group."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from . import runner

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def write_dataset(path, target_bytes: int, seed: int = 0) -> int:
    """~12 KB prompts of long random words (cheap to tokenize: few tokens per byte), short
    answers, uncompressed, in row groups of 4096 rows (~50 MB)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    pool = [" ".join(letters[rng.integers(0, 26, (12, 1000))].view("S1000").astype(str).ravel()) for _ in range(64)]
    schema = pa.schema([("prompt", pa.string()), ("response", pa.string())])
    rows_per_group, written, k = min(4096, max(1, target_bytes // 12_000)), 0, 0
    # No compression and no dictionary: the bytes on disk are the bytes a reader must stream.
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as w:
        while written < target_bytes:
            prompts = [pool[(k + i) % len(pool)] for i in range(rows_per_group)]
            k += rows_per_group
            w.write_table(pa.table({"prompt": prompts, "response": ["the kiwi is teal ."] * rows_per_group},
                                   schema=schema))
            written += sum(len(p) for p in prompts)
    return path.stat().st_size


def peak_rss(out) -> float:
    return max(r["max_rss_mb"] for r in runner.read_metrics(out) if "max_rss_mb" in r)


def test_rss_does_not_grow_with_a_1gb_dataset(assets, tmp_path):
    small, big = tmp_path / "small.parquet", tmp_path / "big.parquet"
    assert write_dataset(small, 5 << 20) < 12 << 20  # ~10 MB on disk
    assert write_dataset(big, 1 << 30, seed=1) >= 1 << 30
    peaks = {}
    for name, data in (("small", small), ("big", big)):
        out = tmp_path / name
        args = runner.base_args(assets, out, **{"data.train_files": data, "data.max_length": 64,
                                                "data.truncation": "left", "trainer.total_training_steps": 3,
                                                "data.micro_batch_size_per_gpu": 2})
        res = runner.run(args, out, nproc=2, timeout=1800)
        assert res.code == 0, res.why()
        peaks[name] = peak_rss(out)
    assert peaks["big"] - peaks["small"] < 300, peaks
