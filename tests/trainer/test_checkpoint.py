"""The Checkpointer's commit protocol on real DCP checkpoints of a small module.

Two stores: a local directory written in place (what a local output_dir is), and one
that stages under a scratch directory and publishes by moving files, exactly the path an
s3:// output takes (stage, upload, report, commit), so the S3 logic runs without a server.
"""
import json
import os
import threading
import time

import pytest
import torch

from sftjob_trainer import checkpoint as ckpt
from sftjob_trainer.checkpointer import Background, Checkpointer, Inline
from sftjob_contract.layout import COMMITTED, LATEST, MANIFEST, checkpoint_dir
from sftjob_trainer.storage import LocalDir, UploadError

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


class RecordingStore(LocalDir):
    """A store staged like S3 that logs every write, and can hold publishing until released."""

    def __init__(self, root, scratch):
        super().__init__(root, scratch)
        self.events: list[str] = []
        self.release = threading.Event()
        self.release.set()

    def publish_dir(self, staged, rel, deadline=None, replace=False):
        self.release.wait()
        files = super().publish_dir(staged, rel, deadline, replace)
        self.events += [f"{rel}/{name}" for name in files]
        return files

    def put_bytes(self, rel, body, deadline=None):
        self.events.append(rel)
        super().put_bytes(rel, body, deadline)

    def delete_dir(self, rel):
        self.events.append(f"delete {rel}")
        super().delete_dir(rel)


@pytest.fixture(params=["in-place", "staged"])
def store(request, tmp_path):
    return LocalDir(tmp_path / "out") if request.param == "in-place" else RecordingStore(tmp_path / "out",
                                                                                          tmp_path / "scratch")


def checkpointer(store, keep=5, strategy=None, world=1, deadline_s=30.0) -> Checkpointer:
    return Checkpointer(store, rank=0, world=world, keep=keep, deadline_s=deadline_s, strategy=strategy or Inline())


def test_roundtrip_restores_weights_optimizer_and_state(store):
    ck = checkpointer(store)
    model, opt = make(0)
    ck.save(model, opt, state(3))
    other, other_opt = make(1)
    assert ck.resumable() == 3
    assert ck.load(3, other, other_opt) == state(3)
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_marker_is_written_after_every_file_and_latest_after_it(tmp_path):
    store = RecordingStore(tmp_path / "out", tmp_path / "scratch")
    model, opt = make(0)
    checkpointer(store).save(model, opt, state(2))
    rel = checkpoint_dir(2)
    marker = store.events.index(f"{rel}/{COMMITTED}")
    assert marker == len(store.events) - 2 and store.events[-1] == f"checkpoints/{LATEST}"
    manifest = json.loads((store.root / rel / MANIFEST).read_text())["files"]
    assert any(name.endswith(".distcp") for name in manifest) and ".metadata" in manifest
    assert all(store.events.index(f"{rel}/{name}") < marker for name in manifest)
    assert store.events.index(f"{rel}/{MANIFEST}") < marker


def test_shards_are_copied_when_save_returns_not_when_written(store):
    """Training goes on while the shards are written: the checkpoint must hold the
    weights of the step it was taken at, not whatever the next steps made of them."""
    ck = checkpointer(store, strategy=Background())
    model, opt = make(0)
    want = model.weight.detach().clone()
    ck.save(model, opt, state(1))
    with torch.no_grad():
        model.weight.add_(1.0)  # the next optimizer step, while the write may be running
    assert ck.wait() == 1
    other, other_opt = make(1)
    ck.load(1, other, other_opt)
    assert torch.equal(other.weight, want)


def test_uncommitted_checkpoint_is_never_resumed(store):
    ck = checkpointer(store)
    model, opt = make(0)
    ck.save(model, opt, state(2))
    store.put_bytes(f"{checkpoint_dir(4)}/__0_0.distcp", b"partial")  # shards of step 4, no marker: the process died
    assert ckpt.steps(store) == [4, 2]
    assert ck.resumable() == 2


def test_corrupt_manifest_or_shard_falls_back_to_previous(store, caplog):
    ck = checkpointer(store)
    model, opt = make(0)
    for step in (1, 2):
        ck.save(model, opt, state(step))
    store.put_bytes(f"{checkpoint_dir(2)}/{MANIFEST}", b"{not json")
    assert ck.resumable() == 1
    assert "unreadable manifest" in caplog.text
    # A shard that does not match the manifest is just as unusable.
    manifest = json.loads(store.get_bytes(f"{checkpoint_dir(1)}/{MANIFEST}"))["files"]
    shard = next(k for k in manifest if k.endswith(".distcp"))
    store.put_bytes(f"{checkpoint_dir(1)}/{shard}", b"x")
    assert ck.resumable() is None


def test_retention_keeps_newest_and_drops_stale_partials(store):
    ck = checkpointer(store, keep=2)
    model, opt = make(0)
    store.put_bytes(f"{checkpoint_dir(1)}/__0_0.distcp", b"stale partial from an earlier crash")
    for step in (2, 3, 4):
        ck.save(model, opt, state(step))
    assert ckpt.steps(store) == [4, 3]
    assert all(ckpt.verify(store, s) is None for s in (3, 4))


def test_prune_runs_only_after_the_new_marker(tmp_path):
    store = RecordingStore(tmp_path / "out", tmp_path / "scratch")
    ck = checkpointer(store, keep=1)
    model, opt = make(0)
    ck.save(model, opt, state(1))
    store.events.clear()
    ck.save(model, opt, state(2))
    deleted = store.events.index(f"delete {checkpoint_dir(1)}")
    assert deleted > store.events.index(f"{checkpoint_dir(2)}/{COMMITTED}")


def test_a_failed_commit_prunes_nothing(tmp_path, caplog):
    """World of 2 where rank 1 never publishes: step 2 cannot commit, so step 1 stays."""
    store = LocalDir(tmp_path / "out", tmp_path / "scratch")
    model, opt = make(0)
    checkpointer(store, keep=1).save(model, opt, state(1))
    # A report from an earlier attempt at the same step must not stand in for rank 1.
    store.put_bytes(f"{checkpoint_dir(2)}/_ranks/rank-1.json", json.dumps({"attempt": "old", "files": {}}).encode())
    lonely = checkpointer(store, keep=1, world=2, deadline_s=1.0)
    with pytest.raises(UploadError, match="only 1 of 2 ranks"):
        lonely.save(model, opt, state(2), final=True)
    assert "checkpoint step-2 was NOT committed" in caplog.text
    assert ckpt.verify(store, 2) == "no commit marker"
    assert ckpt.verify(store, 1) is None and lonely.resumable() == 1


def test_commit_abandoned_at_the_stop_deadline_never_commits(tmp_path, caplog):
    store = RecordingStore(tmp_path / "out", tmp_path / "scratch")
    ck = checkpointer(store, keep=1, strategy=Background())
    model, opt = make(0)
    ck.save(model, opt, state(1), final=True)
    store.release.clear()  # the store hangs
    t0 = time.monotonic()
    with pytest.raises(UploadError, match="stop deadline"):
        ck.save(model, opt, state(2), final=True, until=t0 + 1.0)
    assert time.monotonic() - t0 < 3.0
    store.release.set()  # the store comes back while the abandoned commit still runs
    time.sleep(1.0)
    assert "checkpoint step-2 was NOT committed" in caplog.text
    assert ckpt.verify(store, 2) == "no commit marker"
    assert ck.resumable() == 1 and ckpt.verify(store, 1) is None


def test_sigterm_is_not_stuck_behind_a_slow_commit(tmp_path, caplog):
    """After SIGTERM the stop checkpoint must not wait for the previous commit; that one
    carries on, and both commit, in order."""
    store = RecordingStore(tmp_path / "out", tmp_path / "scratch")
    ck = checkpointer(store, strategy=Background())
    committed: list[int] = []
    ck.on_commit = committed.append
    model, opt = make(0)
    store.release.clear()
    ck.save(model, opt, state(1))
    time.sleep(0.5)
    assert committed == []  # still publishing: not reported as committed
    t0 = time.monotonic()
    ck.save(model, opt, state(2), stopping=lambda: True)
    assert time.monotonic() - t0 < 2.0
    assert "not waiting for checkpoint step-1 to commit" in caplog.text
    store.release.set()
    assert ck.wait() == 2
    assert committed == [1, 2] and ck.resumable() == 2


def test_a_new_save_waits_for_the_previous_commit(tmp_path):
    """Without SIGTERM a save never overtakes the one before it: commits stay in step order
    and at most one checkpoint is in flight."""
    store = RecordingStore(tmp_path / "out", tmp_path / "scratch")
    ck = checkpointer(store, strategy=Background())
    committed: list[int] = []
    ck.on_commit = committed.append
    model, opt = make(0)
    store.release.clear()
    ck.save(model, opt, state(1))
    second = threading.Thread(target=ck.save, args=(model, opt, state(2)))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive() and committed == []
    store.release.set()
    second.join(timeout=30)
    assert ck.wait() == 2 and committed == [1, 2]


def test_a_final_save_makes_no_host_copy_and_frees_the_earlier_ones(store, monkeypatch):
    """Nothing trains after a final save (end of training, SIGTERM), so its shards are written from the live
    tensors: a host copy would double the memory of the parameters and optimizer state at the very end (a
    1B full fine-tune on 2 CPU ranks was OOM-killed there). The copies kept from periodic saves go too."""
    stagers = []

    class Counting(ckpt.DefaultStager):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.staged, self.closed = 0, False
            stagers.append(self)

        def stage(self, state_dict, **kw):
            self.staged += 1
            return super().stage(state_dict, **kw)

        def close(self):
            self.closed = True
            super().close()

    monkeypatch.setattr(ckpt, "DefaultStager", Counting)
    ck = checkpointer(store, strategy=Background())
    model, opt = make(0)
    ck.save(model, opt, state(1))
    assert [s.staged for s in stagers] == [1]  # a periodic save copies: training goes on
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.save(model, opt, state(2), final=True)
    assert sum(s.staged for s in stagers) == 1, "the final save copied its shards to host memory"
    assert stagers[0].closed, "the host copies of the periodic save were kept after the final save"
    other, other_opt = make(1)
    assert ck.resumable() == 2
    ck.load(2, other, other_opt)
    assert torch.equal(other.weight, model.weight)
    ck.close()


def test_listing_ignores_a_file_renamed_while_it_is_listed(tmp_path, monkeypatch):
    """CI saw rank 0 fail a requested checkpoint with FileNotFoundError on
    ``_ranks/rank-1.json.tmp``: rank 1's atomic write renamed it between rank 0's
    directory listing and its size lookup. The listing is a snapshot; a file that goes
    away while it is taken is simply not in it."""
    store = LocalDir(tmp_path)
    store.put_bytes("step-7/_ranks/rank-0.json", b"{}")
    tmp = tmp_path / "step-7" / "_ranks" / "rank-1.json.tmp"
    tmp.write_bytes(b"{}")
    real_stat = type(tmp).stat
    seen: list[str] = []

    def stat_then_rename(self, *a, **kw):  # the peer's os.replace lands right after this look
        result = real_stat(self, *a, **kw)
        if self.name == tmp.name and not seen and os.path.exists(tmp):
            seen.append(self.name)
            os.replace(tmp, tmp.with_name("rank-1.json"))
        return result

    monkeypatch.setattr(type(tmp), "stat", stat_then_rename)
    listed = store.list("step-7/_ranks")
    assert seen, "the race was not exercised"
    assert "rank-0.json" in listed
    assert set(listed) <= {"rank-0.json", "rank-1.json", "rank-1.json.tmp"}
