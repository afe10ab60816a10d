"""Fencing (fence.py): a stale attempt can never commit, prune or publish. The claims and
checks run against a local directory and against a real MinIO (S3 conditional writes)."""
from __future__ import annotations

import pytest

from sftjob_trainer.errors import Superseded
from sftjob_trainer.fence import Fence
from sftjob_trainer.storage import LocalDir
from sftjob_contract.layout import OWNER

from .minio import MinioServer

BUCKET = "sftjob-fence"


@pytest.fixture(scope="module")
def minio(tmp_path_factory):
    server = MinioServer(tmp_path_factory.mktemp("minio"))
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def _s3_store(minio, monkeypatch, prefix):
    from sftjob_trainer.s3store import S3Prefix

    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    return S3Prefix(f"s3://{BUCKET}/{prefix}")


def _stale_attempt_is_refused(store) -> None:
    old = Fence.claim(store, attempt=1, token="run-a")
    old.check("commit")                                   # alone: its own
    new = Fence.claim(store, attempt=2, token="run-b")    # the operator started the next gang
    with pytest.raises(Superseded, match="attempt 2 has taken over"):
        old.check("commit checkpoint step-10")
    new.check("commit")
    with pytest.raises(Superseded, match="attempt 2 already owns"):
        Fence.claim(store, attempt=1, token="run-a2")       # never back over a newer attempt
    new.check("commit")
    # The same attempt number run again (a local re-run): the later claim wins.
    again = Fence.claim(store, attempt=2, token="run-c")
    with pytest.raises(Superseded):
        new.check("prune")
    again.check("prune")


def _a_lost_race_is_decided_again(store) -> None:
    assert store.get_tagged(OWNER) is None
    assert store.put_if(OWNER, b'{"attempt": 1, "token": "x"}', None)
    assert not store.put_if(OWNER, b'{"attempt": 1, "token": "y"}', None)    # exists now
    body, tag = store.get_tagged(OWNER)
    assert store.put_if(OWNER, b'{"attempt": 2, "token": "z"}', tag)
    assert not store.put_if(OWNER, b'{"attempt": 3, "token": "w"}', tag)    # what it read is gone
    assert store.get_tagged(OWNER)[0] == b'{"attempt": 2, "token": "z"}'


@pytest.mark.unit
def test_stale_attempt_is_refused_on_a_local_directory(tmp_path):
    _stale_attempt_is_refused(LocalDir(tmp_path / "out"))
    _a_lost_race_is_decided_again(LocalDir(tmp_path / "race"))


@pytest.mark.cluster  # needs the MinIO binary that hack/ builds
def test_stale_attempt_is_refused_on_s3(minio, monkeypatch):
    _stale_attempt_is_refused(_s3_store(minio, monkeypatch, "runs/fence"))
    _a_lost_race_is_decided_again(_s3_store(minio, monkeypatch, "runs/race"))


def _stale_checkpointer_is_refused(store, committed) -> None:
    from sftjob_trainer.checkpointer import Checkpointer, Inline

    from .test_checkpoint import make, state

    model, opt = make(0)
    old = Checkpointer(store, rank=0, world=1, keep=1, deadline_s=30.0, strategy=Inline())
    old.fence = Fence.claim(store, attempt=3, token=old.attempt)
    old.save(model, opt, state(1))
    new = Checkpointer(store, rank=0, world=1, keep=1, deadline_s=30.0, strategy=Inline())
    new.fence = Fence.claim(store, attempt=4, token=new.attempt)
    new.save(model, opt, state(2))
    with pytest.raises(Superseded, match="attempt 4 has taken over"):
        old.save(model, opt, state(3))
        old.save(model, opt, state(4))   # a failure surfaces at the latest at the next save
    assert committed() == [2]             # the stale step-3 never committed, and step-2 was not pruned
    assert store.get_bytes("checkpoints/latest").strip() == b"2"


def _committed(store):
    return lambda: sorted(int(n.split("/")[0].removeprefix("step-")) for n in store.list("checkpoints")
                          if n.endswith("/COMMITTED"))


@pytest.mark.unit
def test_a_stale_checkpointer_neither_commits_nor_prunes(tmp_path):
    """Two attempts write one prefix (a partitioned node's rank still reaches the store): the
    old one's next commit is refused, and it deletes nothing the current one resumes from."""
    store = LocalDir(tmp_path / "out", tmp_path / "scratch")
    _stale_checkpointer_is_refused(store, _committed(store))


@pytest.mark.cluster  # needs the MinIO binary that hack/ builds
def test_a_stale_checkpointer_neither_commits_nor_prunes_on_s3(minio, monkeypatch, tmp_path):
    monkeypatch.setenv("SFTJOB_LOCAL_DIR", str(tmp_path / "scratch"))
    store = _s3_store(minio, monkeypatch, "runs/stale")
    _stale_checkpointer_is_refused(store, _committed(store))


@pytest.mark.unit
@pytest.mark.parametrize("scratch", [False, True])   # written in place, or staged then published as to S3
def test_a_stale_attempt_cannot_publish_the_export(tmp_path, monkeypatch, scratch):
    from sftjob_trainer.outputs import Outputs

    def store():
        return LocalDir(tmp_path / "out", tmp_path / "scratch" if scratch else None)

    monkeypatch.setenv("SFTJOB_ATTEMPT", "5")
    old = Outputs(store(), rank=0, world=1, keep=2, upload_deadline_s=10.0)
    monkeypatch.setenv("SFTJOB_ATTEMPT", "6")
    new = Outputs(store(), rank=0, world=1, keep=2, upload_deadline_s=10.0)
    new.write_dir("hf", lambda d: (d / "model.safetensors").write_bytes(b"current"))
    with pytest.raises(Superseded, match="attempt 6 has taken over"):
        old.write_dir("hf", lambda d: (d / "model.safetensors").write_bytes(b"stale"))
    assert (tmp_path / "out" / "hf" / "model.safetensors").read_bytes() == b"current"
