"""A checkpoint that cannot commit ends the run instead of passing silently.

Before, a failed periodic commit was only logged and training went on: a store refusing
every write (read-only credentials) surfaced at the final save, after all the training a
restart then redid from step 0. Now a permanent cause (the store denies, the disk is full)
ends the run at the next step or save boundary, `max_failed_commits` transient failures in
a row do too, and the last committed step moves only when a marker is written.

The stores here are real Store implementations (a local directory staged like S3) whose
publish fails the way a refusing or flaky S3 does.
"""
from __future__ import annotations

import json
import math
import time

import pytest

from sftjob_contract.config import load_config
from sftjob_contract.layout import RANK_REPORTS, checkpoint_dir
from sftjob_trainer import checkpoint as ckpt
from sftjob_trainer import dist as dist_utils
from sftjob_trainer import outputs
from sftjob_trainer.checkpointer import Checkpointer, Inline
from sftjob_trainer.errors import CheckpointFailed, StorageDenied
from sftjob_trainer.storage import LocalDir, UploadError
from sftjob_trainer.train import StopFlag, Trainer

from . import runner
from .test_checkpoint import make, state
from .test_metrics import free_port, scrape

pytestmark = pytest.mark.unit


class DeniedStore(LocalDir):
    """Reads work, writes of shards are refused: output credentials that can read but not write."""

    def __init__(self, root, scratch):
        super().__init__(root, scratch)
        self.publishes = 0

    def publish_dir(self, staged, rel, deadline=None, replace=False):
        self.publishes += 1
        raise StorageDenied(f"spec.storage.uri {self.uri}: AccessDenied on PutObject {rel}/ (the credentials "
                            "may read but not write)")


class FlakyStore(LocalDir):
    """Publishing fails (as an S3 upload does after its retries) whenever ``fails`` says so."""

    def __init__(self, root, scratch, fails):
        super().__init__(root, scratch)
        self.fails = list(fails)

    def publish_dir(self, staged, rel, deadline=None, replace=False):
        if self.fails.pop(0) if self.fails else True:
            raise UploadError(f"upload {self.uri}/{rel}: failed after 5 attempts: 503 SlowDown")
        return super().publish_dir(staged, rel, deadline, replace)


def committed_steps(root) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("checkpoints/step-*/COMMITTED"))


# --------------------------------------------------------------------------- the Checkpointer


def test_a_denied_commit_ends_the_run_at_the_next_save(tmp_path):
    store = DeniedStore(tmp_path / "out", tmp_path / "scratch")
    ck = Checkpointer(store, rank=0, world=1, keep=5, deadline_s=10.0, strategy=Inline())
    committed, failed = [], []
    ck.on_commit, ck.on_failed_commit = committed.append, failed.append
    model, opt = make(0)
    ck.save(model, opt, state(1))
    with pytest.raises(StorageDenied, match="spec.storage.uri .*AccessDenied"):
        for step in (2, 3):  # the next two periodic saves
            ck.save(model, opt, state(step))
    assert store.publishes == 1, "a save was written after the store had refused the one before"
    assert committed == [] and failed == [1] and committed_steps(tmp_path / "out") == []


def test_transient_failures_end_the_run_after_max_failed_commits_in_a_row(tmp_path):
    # fail, fail, commit (resets the count), then three failures in a row: the third ends the run
    store = FlakyStore(tmp_path / "out", tmp_path / "scratch", [True, True, False, True, True, True, False])
    ck = Checkpointer(store, rank=0, world=1, keep=5, deadline_s=10.0, strategy=Inline(), max_failed_commits=3)
    model, opt = make(0)
    saved = []
    with pytest.raises(CheckpointFailed) as err:
        for step in range(1, 8):
            ck.save(model, opt, state(step))
            saved.append(step)
            ck.end_if_failed(ck.poll())  # the trainer's step boundary
    assert saved == [1, 2, 3, 4, 5, 6], "the run must end at the third failure in a row, and not at the second"
    assert "3 checkpoint commits in a row failed" in str(err.value) and "503 SlowDown" in str(err.value)
    assert f"spec.storage.uri ({store.uri})" in str(err.value) and "maxFailedCommits=3" in str(err.value)
    assert committed_steps(tmp_path / "out") == [3]


def test_a_full_disk_ends_the_run_at_the_first_failed_commit(tmp_path):
    class FullDisk(LocalDir):
        def publish_dir(self, staged, rel, deadline=None, replace=False):
            raise OSError(28, "No space left on device", str(staged))

    store = FullDisk(tmp_path / "out", tmp_path / "scratch")
    ck = Checkpointer(store, rank=0, world=1, keep=5, deadline_s=10.0, strategy=Inline(), max_failed_commits=3)
    model, opt = make(0)
    ck.save(model, opt, state(1))
    with pytest.raises(ckpt.CheckpointIOError) as err:
        ck.end_if_failed(ck.poll())
    assert "is full" in str(err.value) and str(tmp_path / "scratch") in str(err.value)
    assert "spec.checkpoint.keep" in str(err.value) and "spec.storage.persistentVolumeClaim" in str(err.value)


def test_rank_0_stops_waiting_for_a_rank_that_reported_its_failure(tmp_path):
    """A rank whose upload failed says so, so rank 0 does not wait for its report until the
    upload deadline (10 minutes by default) while the run is ending."""
    store = LocalDir(tmp_path / "out", tmp_path / "scratch")
    lonely = Checkpointer(store, rank=0, world=2, keep=5, deadline_s=60.0, strategy=Inline())
    ckpt.report_failure(store, 1, 1, lonely.attempt, UploadError("503 SlowDown"))
    model, opt = make(0)
    t0 = time.monotonic()
    with pytest.raises(UploadError, match="rank-1 could not publish its shards: UploadError: 503 SlowDown"):
        lonely.save(model, opt, state(1), final=True)
    assert time.monotonic() - t0 < 10.0
    body = json.loads(store.get_bytes(f"{checkpoint_dir(1)}/{RANK_REPORTS}/rank-1.json"))
    assert "files" not in body and committed_steps(tmp_path / "out") == []


# --------------------------------------------------------------------------- the Trainer


def trainer(assets, out, store, monkeypatch, **over) -> Trainer:
    monkeypatch.setattr(outputs, "open_store", lambda uri, deadline_s: store)
    cfg = load_config(None, runner.base_args(assets, out, **{"trainer.total_training_steps": 10,
                                                             "trainer.save_freq": 1, **over}))
    return Trainer(cfg, dist_utils.init_world(), StopFlag())


def test_trainer_stops_at_the_first_denied_commit_and_never_reports_it_committed(assets, tmp_path, monkeypatch):
    """Three periodic saves over a store that denies writes used to pass silently (the trainer
    believed step 3 committed) and the error came only at the end, after all ten steps."""
    out, port = tmp_path / "out", free_port()
    store = DeniedStore(out, tmp_path / "scratch")
    t = trainer(assets, out, store, monkeypatch, **{"trainer.metrics_port": port})
    try:
        with pytest.raises(StorageDenied, match="AccessDenied"):
            t.train()
        seen = scrape(port)
    finally:
        t.close()
    assert t.state.step <= 2, f"trained on to step {t.state.step} after the store refused step 1"
    assert store.publishes == 1
    assert t.last_committed == -1 and seen["sftjob_trainer_last_checkpoint_step"] == 0
    assert seen["sftjob_trainer_failed_checkpoint_commits_total"] == 1
    assert committed_steps(out) == [] and not (out / "hf").exists()


def test_trainer_ends_with_checkpoint_failed_after_max_failed_commits(assets, tmp_path, monkeypatch):
    out, port = tmp_path / "out", free_port()
    store = FlakyStore(out, tmp_path / "scratch", [])  # every publish fails
    t = trainer(assets, out, store, monkeypatch, **{"trainer.metrics_port": port, "trainer.max_failed_commits": 2})
    try:
        with pytest.raises(CheckpointFailed, match=r"2 checkpoint commits in a row failed.*spec\.storage\.uri"):
            t.train()
        seen = scrape(port)
    finally:
        t.close()
    assert t.state.step <= 3, f"trained on to step {t.state.step} after two failed commits"
    assert seen["sftjob_trainer_failed_checkpoint_commits_total"] == 2
    assert math.isnan(seen["sftjob_trainer_last_checkpoint_timestamp_seconds"]), "no checkpoint has a time"
    assert t.last_committed == -1 and committed_steps(out) == []
