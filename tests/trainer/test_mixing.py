"""Weighted data mixing (data.sources): proportions, exactly-once per epoch, resume at another
world size, the per-source preflight report. Pure order logic on real scanned sources: no
process group is needed, since the order never depends on the world size."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sftjob_contract.config import DataConfig
from sftjob_trainer import mixing
from tools.assets import make_chats, make_rows, write_parquet
from sftjob_trainer.batching import GlobalBatches
from sftjob_trainer.data import SampleBuilder

pytestmark = pytest.mark.unit

WEIGHTS = {"qa": 0.5, "chat": 0.3, "trivia": 0.2}
SEED = 7


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "model")


def write_jsonl(path: Path, rows: list[dict], blank_every: int = 0) -> str:
    lines = []
    for i, row in enumerate(rows):
        lines.append(json.dumps(row))
        if blank_every and i % blank_every == 0:
            lines.append("   ")   # blank lines are not rows
    body = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(body) if path.suffix == ".gz" else body)
    return str(path)


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict:
    """qa: 200 single-turn parquet rows (small row groups); chat: 60 multi-turn JSONL rows with
    blank lines; trivia: 40 single-turn rows with their own keys in .jsonl.gz, one of them
    with an empty answer (dropped)."""
    d = tmp_path_factory.mktemp("mix")
    write_parquet(make_rows(200, seed=1), d / "qa" / "part-0.parquet", row_group_size=32)
    write_jsonl(d / "chat.jsonl", make_chats(60, seed=2), blank_every=7)
    trivia = [{"question": r["prompt"], "answer": r["response"]} for r in make_rows(40, seed=3)]
    trivia[5]["question"] = "what comes after one ? " * 20   # right truncation cuts its whole answer: dropped
    write_jsonl(d / "trivia.jsonl.gz", trivia)
    return {"data": {"sources": [
        {"name": "qa", "files": [str(d / "qa")], "weight": WEIGHTS["qa"]},
        {"name": "chat", "files": [str(d / "chat.jsonl")], "weight": WEIGHTS["chat"], "messages_key": "messages"},
        {"name": "trivia", "files": [str(d / "*.jsonl.gz")], "weight": WEIGHTS["trivia"],
         "prompt_key": "question", "response_key": "answer"},
    ], "max_length": 64, "truncation": "right", "train_batch_size": 8, "micro_batch_size_per_gpu": 2}}


def build(tok, spec: dict, **over) -> tuple[DataConfig, mixing.MixedDataset]:
    cfg = DataConfig(**{**spec["data"], **over})
    return cfg, mixing.train_dataset(tok, cfg, SampleBuilder(tok, cfg))


def test_each_epoch_mixes_the_weights_and_uses_each_source_row_pass_once(tok, three):
    cfg, ds = build(tok, three)
    usable = {n: len(p.valid) for n, p in zip(ds.names, ds.parts)}
    assert usable == {"qa": 200, "chat": 60, "trivia": 39}
    n = sum(usable.values())
    assert ds.epoch_size == n
    seen_pass0: dict[int, list[int]] = {s: [] for s in range(3)}
    for epoch in range(3):
        labels, rows, passes = ds.epoch_plan(SEED, epoch, True)
        counts = Counter(labels.tolist())
        for s, name in enumerate(ds.names):
            # Realized proportions: the weight's share of the epoch, to within one sample.
            assert abs(counts[s] / n - WEIGHTS[name]) <= 1 / n, (name, counts[s], n)
            mine = rows[labels == s]
            assert set(mine.tolist()) <= set(ds.parts[s].valid.tolist())
            seen_pass0[s] += mine[passes[labels == s] == 0].tolist()
        triples = list(zip(labels.tolist(), rows.tolist(), passes.tolist()))
        assert len(set(triples)) == len(triples), "a (source, row, pass) repeated within an epoch"
        # The sources are spread over the epoch, not in blocks: every quarter holds each.
        for quarter in np.array_split(labels, 4):
            assert set(quarter.tolist()) == {0, 1, 2}
    # Over the epochs, pass 0 of every source is each of its usable rows exactly once:
    # the downsampled qa goes on where the last epoch stopped, the others repeat whole passes.
    for s, part in enumerate(ds.parts):
        assert sorted(seen_pass0[s]) == sorted(part.valid.tolist()), ds.names[s]
    assert cfg.source_names() == ["qa", "chat", "trivia"]


def test_the_order_is_seeded_and_independent_of_the_world_size(tok, three):
    _, ds = build(tok, three)
    _, again = build(tok, three)
    assert np.array_equal(ds.epoch_order(SEED, 1, True), again.epoch_order(SEED, 1, True))
    assert not np.array_equal(ds.epoch_order(SEED, 1, True), ds.epoch_order(SEED + 1, 1, True))
    assert not np.array_equal(ds.epoch_order(SEED, 0, True), ds.epoch_order(SEED, 1, True))


def trained_ids(cfg, ds, world: int, epoch: int, cursors: list[int]) -> list[list[int]]:
    """Each global step's sample ids, gathered over ``world`` data-parallel ranks."""
    ranks = [GlobalBatches(ds, cfg, SEED, r, world, pad_id=0) for r in range(world)]
    return [sorted(i for b in ranks for mb in b.step_batches(epoch, c) for i in mb.sample_ids) for c in cursors]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_a_resume_mid_epoch_at_another_world_size_trains_the_same_samples(tok, three, before, after):
    cfg, ds = build(tok, three, max_tokens_per_micro_batch=96)
    batch = cfg.train_batch_size
    steps = ds.epoch_size // batch
    cursors = [k * batch for k in range(steps)]
    epoch = 1
    reference = trained_ids(cfg, ds, 1, epoch, cursors)
    stop = steps // 2 + 1   # the checkpoint: mid-epoch
    resumed = trained_ids(cfg, ds, before, epoch, cursors[:stop]) + trained_ids(cfg, ds, after, epoch, cursors[stop:])
    assert resumed == reference
    order = ds.epoch_order(SEED, epoch, True)
    assert reference == [sorted(order[c : c + batch].tolist()) for c in cursors]


def test_a_sample_is_its_source_row_with_that_source_columns(tok, three):
    _, ds = build(tok, three)
    labels, rows, _ = ds.epoch_plan(SEED, 0, True)
    order = ds.epoch_order(SEED, 0, True)
    squash = lambda text: "".join(text.split())  # noqa: E731 - the tiny tokenizer's decoder drops some spaces
    for source, keys in ((1, None), (2, ("question", "answer"))):
        k = next(k for k, s in enumerate(labels) if s == source)
        row = ds.parts[source].rows.row(int(rows[k]))
        text = squash(tok.decode(ds.sample(int(order[k])).input_ids))
        parts = [m["content"] for m in row["messages"]] if keys is None else [row[key] for key in keys]
        assert all(squash(p) in text for p in parts), (row, text)


def test_the_preflight_report_per_source(tok, three):
    _, ds = build(tok, three)
    found = {r.source: r for r in mixing.reports(ds)}
    qa, chat, trivia = found["qa"], found["chat"], found["trivia"]
    assert (trivia.format, trivia.rows, trivia.usable, trivia.dropped, trivia.truncated) == ("jsonl", 40, 39, 1, 1)
    assert (chat.format, chat.rows, chat.usable) == ("jsonl", 60, 60)
    assert (qa.format, qa.files, qa.rows) == ("parquet", 1, 200)
    assert qa.tokens == int(ds.parts[0].lengths[ds.parts[0].valid].sum()) > 0
    assert sum(r.samples_per_epoch for r in found.values()) == ds.epoch_size
    assert abs(chat.share - 0.3) < 1e-9 and chat.samples_per_epoch == 90
    assert "1 dropped" in trivia.describe() and "'trivia'" in trivia.describe()

    class Recorder:
        def __init__(self):
            self.gauged, self.rows = [], []

        def sources(self, reports):
            self.gauged = [r.source for r in reports]

        def record(self, **row):
            self.rows.append(row)

    m = Recorder()
    mixing.publish_report(m, ds, fresh=True)
    assert m.gauged == ["qa", "chat", "trivia"]
    assert [r["source"] for r in m.rows[0]["preflight"]] == ["qa", "chat", "trivia"]
    assert m.rows[0]["epoch_samples"] == ds.epoch_size
    resumed = Recorder()
    mixing.publish_report(resumed, ds, fresh=False)   # a restart: gauges again, no second line
    assert resumed.gauged and not resumed.rows


def test_truncation_is_counted_per_source(tok, three):
    _, ds = build(tok, three, max_length=12)
    found = {r.source: r for r in mixing.reports(ds)}
    assert found["chat"].truncated > 0 and found["qa"].truncated > 0
    assert all(r.tokens <= 12 * r.usable for r in found.values())


def test_weights_change_the_fingerprint(tok, three):
    _, ds = build(tok, three)
    spec = json.loads(json.dumps(three))
    spec["data"]["sources"][0]["weight"] = 0.6
    _, other = build(tok, spec)
    assert ds.fingerprint() != other.fingerprint()


def test_the_report_is_served_per_source(tok, three):
    import urllib.request

    from sftjob_trainer.metrics import Metrics

    from .test_metrics import free_port

    _, ds = build(tok, three)
    port = free_port()
    m = Metrics(None, port)
    try:
        mixing.publish_report(m, ds, fresh=True)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'sftjob_trainer_source_dropped_rows{source="trivia"} 1.0' in text
    assert 'sftjob_trainer_source_samples_per_epoch{source="chat"} 90.0' in text
    assert 'sftjob_trainer_source_rows{source="qa"} 200.0' in text
