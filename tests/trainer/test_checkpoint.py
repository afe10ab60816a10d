"""Commit markers, manifests and retention, on real DCP checkpoints of a small module."""
import json

import pytest
import torch

from sftjob_trainer import checkpoint as ckpt

pytestmark = pytest.mark.unit


def state(step: int) -> ckpt.TrainerState:
    return ckpt.TrainerState(step=step, epoch=0, cursor=step * 4, total_steps=10, global_batch=4,
                             data_fingerprint="f", world_size=1, tokens_seen=0, lr_scheduler="constant")


def make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_roundtrip_restores_weights_optimizer_and_state(tmp_path):
    store = ckpt.LocalCheckpointDir(tmp_path)
    model, opt = make(0)
    ckpt.save(store, model, opt, state(3), rank=0, keep=2)
    other, other_opt = make(1)
    loaded = ckpt.load(store, 3, other, other_opt)
    assert loaded == state(3)
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_half_written_checkpoint_is_ignored(tmp_path):
    store = ckpt.LocalCheckpointDir(tmp_path)
    model, opt = make(0)
    ckpt.save(store, model, opt, state(2), rank=0, keep=5)
    partial = store.prepare(4)  # shards written, never committed (the process died)
    (partial / "__0_0.distcp").write_bytes(b"partial")
    assert store.steps() == [2, 4]
    assert ckpt.find_resumable(store) == 2


def test_corrupt_manifest_falls_back_to_previous(tmp_path, caplog):
    store = ckpt.LocalCheckpointDir(tmp_path)
    model, opt = make(0)
    for step in (1, 2):
        ckpt.save(store, model, opt, state(step), rank=0, keep=5)
    (store.path(2) / ckpt.MANIFEST).write_text("{not json")
    assert ckpt.find_resumable(store) == 1
    assert "unreadable manifest" in caplog.text
    # A shard that does not match the manifest is just as unusable.
    manifest = json.loads((store.path(1) / ckpt.MANIFEST).read_text())
    shard = next(k for k in manifest["files"] if k.endswith(".distcp"))
    (store.path(1) / shard).write_bytes(b"x")
    assert ckpt.find_resumable(store) is None


def test_retention_keeps_newest_and_drops_stale_partials(tmp_path):
    store = ckpt.LocalCheckpointDir(tmp_path)
    model, opt = make(0)
    store.prepare(1)  # stale partial from an earlier crash
    for step in (2, 3, 4):
        ckpt.save(store, model, opt, state(step), rank=0, keep=2)
    assert store.steps() == [3, 4]
    assert all(store.verify(s) is None for s in (3, 4))


def test_prune_never_leaves_zero_committed(tmp_path):
    store = ckpt.LocalCheckpointDir(tmp_path)
    model, opt = make(0)
    ckpt.save(store, model, opt, state(1), rank=0, keep=1)
    store.prepare(2)  # a newer, uncommitted one must not count as "newest"
    assert store.prune(1) == []
    assert ckpt.find_resumable(store) == 1
