"""Object storage end to end on a real MinIO: s3:// data, model and outputs, exact and elastic resume, faults."""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from . import runner
from .minio import MinioServer

pytestmark = pytest.mark.cluster  # needs the MinIO binary that hack/ builds

BUCKET = "sftjob-test"


@pytest.fixture(scope="module")
def minio(tmp_path_factory, assets):
    server = MinioServer(tmp_path_factory.mktemp("minio"))
    server.start()
    s3 = server.client()
    s3.create_bucket(Bucket=BUCKET)
    for f in sorted((assets / "model").iterdir()):
        s3.upload_file(str(f), BUCKET, f"models/tiny/{f.name}")
    # A small train file: one epoch is 12 global batches of 8, so a test can audit it whole.
    small = tmp_path_factory.mktemp("small") / "train.parquet"
    pq.write_table(pq.read_table(assets / "data" / "train.parquet").slice(0, 96), small, row_group_size=40)
    s3.upload_file(str(small), BUCKET, "data/small/train.parquet")
    s3.upload_file(str(assets / "data" / "val.parquet"), BUCKET, "data/val.parquet")
    server.small_local = small
    yield server
    server.stop()


def s3_args(out_uri: str, **over) -> list[str]:
    args = {
        "model.path": f"s3://{BUCKET}/models/tiny",
        "data.train_files": f"s3://{BUCKET}/data/small/",
        "data.max_length": 64,
        "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 2,
        "optim.lr": 3e-3,
        "optim.lr_scheduler": "cosine",
        "lora.rank": 8,
        "trainer.output_dir": out_uri,
        "trainer.total_training_steps": 12,
        "trainer.log_freq": 4,
        "trainer.log_sample_ids": "true",
    }
    args.update(over)
    return [f"{k}={v}" for k, v in args.items()]


def env_for(minio: MinioServer, tmp_path: Path) -> dict:
    return minio.env | {"SFTJOB_LOCAL_DIR": str(tmp_path / "local"), "SFTJOB_MODEL_CACHE": str(tmp_path / "models")}


def local_metrics_dir(tmp_path: Path, out_uri: str) -> Path:
    return tmp_path / "local" / hashlib.sha256(out_uri.encode()).hexdigest()[:16]


def remote_metrics(minio: MinioServer, prefix: str) -> dict[int, dict]:
    body = minio.client().get_object(Bucket=BUCKET, Key=f"{prefix}/metrics.jsonl")["Body"].read().decode()
    rows = [json.loads(line) for line in body.splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "loss" in r}  # a restarted run's rows win


def test_s3_run_equals_local_run_and_publishes_everything(minio, assets, tmp_path):
    local_out = tmp_path / "local-out"
    local_args = s3_args(str(local_out), **{"data.train_files": minio.small_local, "model.path": assets / "model"})
    ref = runner.run(local_args, local_out, nproc=2)
    assert ref.code == 0, ref.output

    uri = f"s3://{BUCKET}/runs/equal"
    res = runner.run(s3_args(uri, **{"trainer.save_freq": 4}), tmp_path, nproc=2, extra_env=env_for(minio, tmp_path))
    assert res.code == 0, res.why()
    assert f"model: {uri}/hf/final" in res.output
    got = remote_metrics(minio, "runs/equal")
    assert [got[s]["loss"] for s in range(1, 13)] == [r["loss"] for r in ref.steps()]

    keys = minio.keys(BUCKET, "runs/equal/")
    for must in ("checkpoints/latest", "checkpoints/step-12/COMMITTED", "checkpoints/step-12/manifest.json",
                 "hf/final/model.safetensors", "hf/final/tokenizer.json", "hf/adapter/adapter_model.safetensors"):
        assert f"runs/equal/{must}" in keys
    # keep_checkpoints=2: step-4 pruned after step-12 committed, step-8 kept.
    assert not any("/step-4/" in k for k in keys) and any("/step-8/COMMITTED" in k for k in keys)
    # The adapter names the base model the user gave, not the node-local copy it was read from.
    adapter_cfg = json.loads(minio.client().get_object(
        Bucket=BUCKET, Key="runs/equal/hf/adapter/adapter_config.json")["Body"].read())
    assert adapter_cfg["base_model_name_or_path"] == f"s3://{BUCKET}/models/tiny"


def test_sigterm_resume_from_s3_is_exact_and_loses_at_most_one_step(minio, tmp_path):
    env = env_for(minio, tmp_path)
    ref_uri, uri = f"s3://{BUCKET}/runs/sig-ref", f"s3://{BUCKET}/runs/sig"
    ref = runner.run(s3_args(ref_uri), tmp_path, nproc=2, extra_env=env)
    assert ref.code == 0, ref.output
    want = remote_metrics(minio, "runs/sig-ref")

    stopped = runner.run_and_sigterm(s3_args(uri), local_metrics_dir(tmp_path, uri), after_steps=5, nproc=2,
                                     extra_env=env)
    assert stopped.code == 143, stopped.output
    done = max(r["step"] for r in stopped.steps())
    # save_freq is 0: the only checkpoint is the one SIGTERM asked for, at the last finished step.
    assert f"runs/sig/checkpoints/step-{done}/COMMITTED" in minio.keys(BUCKET, "runs/sig/")
    resumed = runner.run(s3_args(uri), tmp_path, nproc=2, extra_env=env)
    assert resumed.code == 0, resumed.output
    assert f"resumed from {uri}/checkpoints/step-{done}" in resumed.output
    got = remote_metrics(minio, "runs/sig")
    assert [got[s]["loss"] for s in range(1, 13)] == [want[s]["loss"] for s in range(1, 13)]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_elastic_resume_uses_every_sample_once(minio, tmp_path, before, after):
    env = env_for(minio, tmp_path)
    ref_uri, uri = f"s3://{BUCKET}/runs/el-ref-{before}{after}", f"s3://{BUCKET}/runs/el-{before}{after}"
    ref = runner.run(s3_args(ref_uri), tmp_path, nproc=before, extra_env=env)
    assert ref.code == 0, ref.output
    want = remote_metrics(minio, f"runs/el-ref-{before}{after}")

    stopped = runner.run_and_sigterm(s3_args(uri), local_metrics_dir(tmp_path, uri), after_steps=5, nproc=before,
                                     extra_env=env)
    assert stopped.code == 143, stopped.output
    resumed = runner.run(s3_args(uri), tmp_path, nproc=after, extra_env=env)
    assert resumed.code == 0, resumed.output
    assert f"saved by {before} processes, now {after}" in resumed.output
    got = remote_metrics(minio, f"runs/el-{before}{after}")
    ids = [i for s in range(1, 13) for i in got[s]["sample_ids"]]
    assert sorted(ids) == list(range(96)), "one epoch must use every sample exactly once"
    assert [got[s]["sample_ids"] for s in range(1, 13)] == [want[s]["sample_ids"] for s in range(1, 13)]
    assert max(abs(got[s]["loss"] - want[s]["loss"]) for s in range(1, 13)) < 1e-4


# --------------------------------------------------------------------------- faults, in process


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def state(step: int):
    from sftjob_trainer.checkpoint import TrainerState

    return TrainerState(step=step, epoch=0, cursor=0, total_steps=10, global_batch=8, data_fingerprint="f",
                        world_size=1, tokens_seen=0, lr_scheduler="cosine")


@pytest.fixture
def s3env(minio, monkeypatch, tmp_path):
    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def checkpoints(uri: str, tmp_path: Path, deadline_s: float = 60.0):
    from sftjob_trainer.checkpointer import Checkpointer
    from sftjob_trainer.storage import S3Prefix

    store = S3Prefix(uri, deadline_s=deadline_s, scratch=tmp_path / "local")
    return Checkpointer(store, rank=0, world=1, keep=1, deadline_s=deadline_s)


def verify(ck, step: int) -> str | None:
    from sftjob_trainer.checkpoint import verify as verify_step

    return verify_step(ck.store, step)


def test_upload_survives_a_minio_restart(minio, s3env):
    ck = checkpoints(f"s3://{BUCKET}/faults/restart", s3env)
    model, opt = small_model()
    minio.stop()
    threading.Timer(3.0, minio.start).start()  # the store comes back while the trainer retries
    ck.save(model, opt, state(1), final=True)
    assert verify(ck, 1) is None and ck.resumable() == 1


def test_upload_that_cannot_finish_fails_loudly_without_a_marker(minio, s3env, caplog):
    from sftjob_trainer.storage import UploadError

    ck = checkpoints(f"s3://{BUCKET}/faults/down", s3env, deadline_s=4.0)
    model, opt = small_model()
    ck.save(model, opt, state(1), final=True)
    minio.stop()
    try:
        with pytest.raises(UploadError):
            ck.save(model, opt, state(2), final=True)
    finally:
        minio.start()
    assert "checkpoint step-2 was NOT committed" in caplog.text
    assert not any("step-2/COMMITTED" in k for k in minio.keys(BUCKET, "faults/down/"))
    assert ck.resumable() == 1


def test_cut_upload_and_corrupt_manifest_fall_back(minio, s3env, caplog):
    uri = f"s3://{BUCKET}/faults/cut"
    ck = checkpoints(uri, s3env)
    ck.keep = 5
    model, opt = small_model()
    for step in (1, 2):
        ck.save(model, opt, state(step), final=True)
    s3 = minio.client()
    # A cut upload: shards of step 3 arrived, the marker never did.
    s3.put_object(Bucket=BUCKET, Key="faults/cut/checkpoints/step-3/__0_0.distcp", Body=b"partial")
    s3.put_object(Bucket=BUCKET, Key="faults/cut/checkpoints/latest", Body=b"3\n")
    assert ck.resumable() == 2
    s3.put_object(Bucket=BUCKET, Key="faults/cut/checkpoints/step-2/manifest.json", Body=b"{broken")
    with caplog.at_level(logging.WARNING):
        assert ck.resumable() == 1
    assert "unreadable manifest" in caplog.text
    # The checkpoint it falls back to really loads.
    other = torch.nn.Linear(8, 8)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    assert ck.load(1, other, other_opt).step == 1
    assert torch.equal(other.weight, model.weight)


def test_retention_never_leaves_zero_committed(minio, s3env):
    ck = checkpoints(f"s3://{BUCKET}/faults/keep", s3env)
    model, opt = small_model()
    for step in (1, 2, 3):
        ck.save(model, opt, state(step), final=True)
    keys = minio.keys(BUCKET, "faults/keep/checkpoints/")
    assert [k for k in keys if k.endswith("COMMITTED")] == ["faults/keep/checkpoints/step-3/COMMITTED"]
    assert ck.resumable() == 3


def test_stop_deadline_abandons_a_hung_upload_without_committing(minio, s3env, caplog):
    """After SIGTERM the trainer must exit within its budget even when the store hangs
    (here: MinIO frozen with SIGSTOP); the abandoned checkpoint never gets a marker."""
    import signal

    from sftjob_trainer.storage import UploadError

    ck = checkpoints(f"s3://{BUCKET}/faults/hung", s3env, deadline_s=120.0)
    model, opt = small_model()
    ck.save(model, opt, state(1), final=True)
    minio.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(UploadError, match="stop deadline"):
            ck.save(model, opt, state(2), final=True, until=t0 + 3.0)
        assert time.monotonic() - t0 < 6.0
    finally:
        minio.proc.send_signal(signal.SIGCONT)
    time.sleep(2.0)  # the abandoned thread may wake up with the store: it must not commit
    assert "checkpoint step-2 was NOT committed" in caplog.text
    assert not any("step-2/COMMITTED" in k for k in minio.keys(BUCKET, "faults/hung/"))
    assert ck.resumable() == 1


def test_sigterm_is_not_stuck_behind_a_slow_upload(minio, s3env, caplog):
    """A periodic save normally waits for the previous upload; after SIGTERM it must not,
    or the stop checkpoint could start only after the grace period. The earlier upload
    carries on and both still commit, in order."""
    import signal

    ck = checkpoints(f"s3://{BUCKET}/faults/slow", s3env, deadline_s=120.0)
    model, opt = small_model()
    minio.proc.send_signal(signal.SIGSTOP)
    try:
        ck.save(model, opt, state(1))  # its upload hangs in the background
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            ck.save(model, opt, state(2), stopping=lambda: True)
        assert time.monotonic() - t0 < 3.0
    finally:
        minio.proc.send_signal(signal.SIGCONT)
    assert "not waiting for checkpoint step-1 to commit" in caplog.text
    assert ck.wait() == 2
    assert verify(ck, 2) is None and ck.resumable() == 2


def test_last_committed_step_is_reported_only_after_the_upload_commits(minio, s3env):
    """status.progress.lastCheckpointStep (the trainer's last_checkpoint_step gauge) must
    never name a checkpoint that is still uploading and could yet be lost."""
    import signal

    ck = checkpoints(f"s3://{BUCKET}/faults/report", s3env, deadline_s=120.0)
    committed: list[int] = []
    ck.on_commit = committed.append
    model, opt = small_model()
    minio.proc.send_signal(signal.SIGSTOP)
    try:
        ck.save(model, opt, state(1))  # written locally; its upload hangs
        time.sleep(1.0)
        assert committed == []
    finally:
        minio.proc.send_signal(signal.SIGCONT)
    assert ck.wait() == 1
    assert committed == [1]


def test_a_parquet_read_rides_out_a_short_s3_outage(minio, monkeypatch):
    """`make chaos` failed a run when its MinIO outage (6 s) hit a data read: pyarrow's S3
    client gave up after its default 3 quick attempts ("Could not connect to server"). A read
    started while S3 is down must wait for it to come back."""
    import threading

    import pyarrow.parquet as pq

    from sftjob_trainer import parquetfs

    for k, v in minio.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", minio.endpoint)
    parquetfs._s3_filesystem.cache_clear()
    fs, path = parquetfs.parquet_filesystem(f"s3://{BUCKET}/data/val.parquet")
    want = pq.read_table(path, filesystem=fs)
    minio.stop()
    restart = threading.Timer(4.0, minio.start)
    restart.start()
    try:
        got = pq.read_table(path, filesystem=fs)
    finally:
        restart.join()
        parquetfs._s3_filesystem.cache_clear()
    assert got.equals(want)


# --------------------------------------------------------------------------- permanent vs transient, on MinIO


def test_model_from_an_empty_minio_prefix_exits_2_naming_spec_model_path(minio, tmp_path):
    out = tmp_path / "out"
    args = s3_args(str(out), **{"model.path": f"s3://{BUCKET}/models/none", "data.train_files": minio.small_local})
    term = tmp_path / "termination-log"
    result = runner.run(args, out, timeout=300,
                        extra_env=env_for(minio, tmp_path) | {"SFTJOB_TERMINATION_LOG": str(term)})
    assert result.code == 2, result.output
    assert term.read_text().startswith(f"InvalidConfig: spec.model.path s3://{BUCKET}/models/none: no objects"), \
        term.read_text()


def test_wrong_minio_credentials_are_denied_at_once_and_never_shown(minio, s3env, monkeypatch):
    """SignatureDoesNotMatch is permanent: StorageDenied naming the field, with no retry
    (the checkpointer ends the run on it) and without the secret in the message."""
    from sftjob_trainer.errors import StorageDenied
    from sftjob_trainer.storage import S3Prefix, local_model_path

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-for-the-test")
    monkeypatch.setenv("SFTJOB_MODEL_CACHE", str(s3env / "models"))
    t0 = time.monotonic()
    with pytest.raises(StorageDenied, match=rf"^spec.storage.uri s3://{BUCKET}/faults/denied: .*SignatureDoesNotMatch"
                       ) as err:
        S3Prefix(f"s3://{BUCKET}/faults/denied", scratch=s3env / "local").put_bytes("checkpoints/latest", b"1")
    with pytest.raises(StorageDenied, match=rf"^spec.model.path s3://{BUCKET}/models/tiny: "):
        local_model_path(f"s3://{BUCKET}/models/tiny")
    assert time.monotonic() - t0 < 10
    assert "wrong-secret-for-the-test" not in str(err.value)
    assert not minio.keys(BUCKET, "faults/denied/")


def test_missing_bucket_is_denied_for_data_and_checkpoints(minio, s3env):
    from sftjob_trainer import parquetfs
    from sftjob_trainer.errors import InvalidData, StorageDenied
    from sftjob_trainer.parquet import resolve_files
    from sftjob_trainer.storage import S3Prefix

    with pytest.raises(StorageDenied, match=r"^spec.storage.uri s3://no-such-bucket/x: .*NoSuchBucket"):
        S3Prefix("s3://no-such-bucket/x", scratch=s3env / "local").list("checkpoints")
    parquetfs._s3_filesystem.cache_clear()
    try:
        for pattern in ("s3://no-such-bucket/d/", "s3://no-such-bucket/d/*.parquet"):
            # pyarrow answers a missing bucket with "not found" or NoSuchBucket: permanent either way
            with pytest.raises((StorageDenied, InvalidData), match=r"^spec.data.trainFiles\[0\] s3://no-such-bucket/d/"):
                resolve_files([pattern])
    finally:
        parquetfs._s3_filesystem.cache_clear()
