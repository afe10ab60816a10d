import json
import math
import socket
import urllib.request

import pytest

from sftjob_trainer.metrics import Metrics, step_flops

pytestmark = pytest.mark.unit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("sftjob_")}


def test_jsonl_and_prometheus_carry_the_same_values(tmp_path):
    port = free_port()
    m = Metrics(tmp_path / "metrics.jsonl", port)
    try:
        before = scrape(port)
        assert math.isnan(before["sftjob_trainer_loss"]), "no loss is known before the first step"
        m.record(step=3, epoch=0, loss=2.5, lr=1e-4, grad_norm=0.7, tokens=120, tokens_per_s=60.0)
        m.count(tokens=120)
        m.record(step=3, val_loss=2.25)
        after = scrape(port)
    finally:
        m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r.pop("time") > 0 for r in rows)  # wall clock of each record
    assert rows == [{"step": 3, "epoch": 0, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.7, "tokens": 120,
                     "tokens_per_s": 60.0}, {"step": 3, "val_loss": 2.25}]
    assert after["sftjob_trainer_step"] == 3 and after["sftjob_trainer_loss"] == 2.5
    assert after["sftjob_trainer_val_loss"] == 2.25 and after["sftjob_trainer_tokens_total"] == 120


def test_step_flops_matches_the_bench_formula():
    # 6·N·T + 6·layers·d_attn·Σs²: N=1000, two sequences of 3 and 5 tokens, 2 layers, d_attn 4.
    assert step_flops(1000, 2, 4, [3, 5]) == 6 * 1000 * 8 + 6 * 2 * 4 * (9 + 25)
