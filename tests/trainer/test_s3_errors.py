"""Retryable vs permanent object-storage failures, on every S3 path of the trainer.

Real failures only: a port where nothing listens (connection refused), a tiny S3 server
that answers ``503 SlowDown`` or ``403 AccessDenied`` to everything, or serves keys MinIO
would refuse. ``SFTJOB_S3_ATTEMPTS=2`` keeps the retries to a second or two.
"""
from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError,
                                 ReadTimeoutError)

from sftjob_trainer import s3errors
from sftjob_trainer.errors import InvalidConfig, StorageDenied, StorageUnavailable, TrainerError

from . import runner
from .s3server import CREDENTIALS, TinyS3, closed_port_endpoint

pytestmark = pytest.mark.unit


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def wrapped(inner: Exception) -> Exception:
    """What boto3's upload_file raises: S3UploadFailedError with the ClientError only as context."""
    from boto3.exceptions import S3UploadFailedError

    try:
        try:
            raise inner
        except ClientError as e:
            raise S3UploadFailedError(f"Failed to upload x to b/k: {e}")  # noqa: B904 - as boto3 does
    except S3UploadFailedError as outer:
        return outer


ARROW = "When reading information for key 'k' in bucket 'b': AWS Error {} during HeadObject operation: x"

TABLE = [
    # botocore, as boto3 raises them
    (client_error("SlowDown", 503), s3errors.TRANSIENT),
    (client_error("Throttling", 400), s3errors.TRANSIENT),
    (client_error("RequestLimitExceeded", 400), s3errors.TRANSIENT),
    (client_error("InternalError", 500), s3errors.TRANSIENT),
    (client_error("ServiceUnavailable", 503), s3errors.TRANSIENT),
    (client_error("SomethingNew", 502), s3errors.TRANSIENT),  # any 5xx
    (client_error("SomethingNew", 429), s3errors.TRANSIENT),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), s3errors.TRANSIENT),
    (ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), s3errors.TRANSIENT),
    (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), s3errors.TRANSIENT),
    (wrapped(client_error("SlowDown", 503)), s3errors.TRANSIENT),
    (client_error("AccessDenied", 403), s3errors.PERMANENT),
    (client_error("InvalidAccessKeyId", 403), s3errors.PERMANENT),
    (client_error("SignatureDoesNotMatch", 403), s3errors.PERMANENT),
    (client_error("NoSuchBucket", 404), s3errors.PERMANENT),
    (client_error("NoSuchKey", 404), s3errors.PERMANENT),
    (client_error("403", 403), s3errors.PERMANENT),  # HeadObject: no body, the code is the status
    (client_error("404", 404), s3errors.PERMANENT),
    (wrapped(client_error("AccessDenied", 403)), s3errors.PERMANENT),
    (NoCredentialsError(), s3errors.PERMANENT),
    # pyarrow's S3 filesystem: an OSError whose text carries the AWS error
    (OSError(ARROW.format("NETWORK_CONNECTION")), s3errors.TRANSIENT),
    (OSError(ARROW.format("SLOW_DOWN")), s3errors.TRANSIENT),
    (OSError(ARROW.format("THROTTLING")), s3errors.TRANSIENT),
    (OSError(ARROW.format("UNKNOWN (HTTP status 503)")), s3errors.TRANSIENT),
    (OSError(ARROW.format("ACCESS_DENIED")), s3errors.PERMANENT),
    (OSError(ARROW.format("NO_SUCH_BUCKET")), s3errors.PERMANENT),
    (OSError(ARROW.format("UNKNOWN (HTTP status 403)")), s3errors.PERMANENT),
    # not storage's doing
    (OSError(28, "No space left on device"), s3errors.UNKNOWN),
    (pa.ArrowInvalid("Parquet magic bytes not found"), s3errors.UNKNOWN),
    (ValueError("x"), s3errors.UNKNOWN),
]


@pytest.mark.parametrize("err,kind", TABLE, ids=[f"{type(e).__name__}-{k}-{i}" for i, (e, k) in enumerate(TABLE)])
def test_classification_table(err, kind):
    assert s3errors.kind(err) == kind
    assert s3errors.is_permanent(err) == (kind == s3errors.PERMANENT)
    made = s3errors.classify(err, "spec.storage.uri", "s3://b/p", tries=3)
    want = {s3errors.TRANSIENT: StorageUnavailable, s3errors.PERMANENT: StorageDenied}.get(kind, TrainerError)
    assert type(made) is want
    assert str(made).startswith("spec.storage.uri s3://b/p")
    assert made.exit_code == (2 if kind == s3errors.PERMANENT else 1)


def test_messages_never_carry_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-key")
    err = EndpointConnectionError(endpoint_url="http://user:very-secret-key@10.0.0.1:9000/b")
    text = str(s3errors.classify(err, "spec.model.path", "s3://b/m"))
    assert "very-secret-key" not in text and "user:" not in text
    assert "10.0.0.1:9000" in text


def test_backoff_grows_with_jitter_and_a_cap():
    waits = [[s3errors.backoff(a) for _ in range(200)] for a in (1, 2, 3, 10)]
    assert all(0.25 <= w <= 0.5 for w in waits[0]) and all(0.5 <= w <= 1.0 for w in waits[1])
    assert len({round(w, 6) for w in waits[2]}) > 100  # jittered, not one value
    assert max(waits[3]) <= 10.0


@pytest.fixture
def s3env(monkeypatch, tmp_path):
    from sftjob_trainer import parquetfs

    def use(endpoint: str) -> Path:
        for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "SFTJOB_S3_ATTEMPTS": "2",
                     "SFTJOB_MODEL_CACHE": str(tmp_path / "models")}.items():
            monkeypatch.setenv(k, v)
        parquetfs._s3_filesystem.cache_clear()
        return tmp_path

    yield use
    parquetfs._s3_filesystem.cache_clear()


# --------------------------------------------------------------------------- model download


def test_model_download_from_a_refusing_endpoint_is_retried_then_unavailable(s3env):
    from sftjob_trainer.storage import local_model_path

    s3env(closed_port_endpoint())
    with pytest.raises(StorageUnavailable, match=r"^spec.model.path s3://b/models/m: .*after 2 attempts"):
        local_model_path("s3://b/models/m")


def test_model_download_throttled_is_retried_then_unavailable(s3env):
    from sftjob_trainer.storage import local_model_path

    with TinyS3(error=(503, "SlowDown")) as server:
        s3env(server.endpoint)
        with pytest.raises(StorageUnavailable, match=r"spec.model.path s3://b/models/m: .*SlowDown"):
            local_model_path("s3://b/models/m")
    assert len(server.requests) >= 2  # retried, not failed at the first answer


def test_model_download_denied_fails_at_once_naming_the_field(s3env):
    from sftjob_trainer.storage import local_model_path

    with TinyS3(error=(403, "AccessDenied")) as server:
        s3env(server.endpoint)
        t0 = time.monotonic()
        with pytest.raises(StorageDenied, match=r"^spec.model.path s3://b/models/m: .*AccessDenied"):
            local_model_path("s3://b/models/m")
    assert len(server.requests) == 1 and time.monotonic() - t0 < 5  # no retry can fix it


def test_model_download_of_an_empty_prefix_is_invalid_config(s3env):
    from sftjob_trainer.storage import local_model_path

    with TinyS3({"b/models/other/config.json": b"{}"}) as server:
        s3env(server.endpoint)
        with pytest.raises(InvalidConfig, match=r"^spec.model.path s3://b/models/m: no objects under this prefix"):
            local_model_path("s3://b/models/m")


@pytest.mark.parametrize("evil", ["../../escaped.txt", "{root}/abs.txt", "sub/../../escaped.txt"])
def test_a_key_outside_the_prefix_is_refused_and_nothing_is_written(s3env, evil):
    """Before the fix the first key landed in the cache's parent and the second, "models/m/"
    plus an absolute path, at that absolute path."""
    from sftjob_trainer.storage import local_model_path

    root = s3env(closed_port_endpoint())
    with TinyS3({"b/models/m/config.json": b"{}", f"b/models/m/{evil.format(root=root)}": b"pwned"}) as server:
        s3env(server.endpoint)
        with pytest.raises(InvalidConfig, match=r"spec.model.path s3://b/models/m: object .* outside the download"):
            local_model_path("s3://b/models/m")
    assert not any(p.read_bytes() == b"pwned" for p in root.rglob("*") if p.is_file())
    assert not [r for r in server.requests if not r.startswith("GET /b?")]  # listed, nothing fetched


def test_model_download_of_honest_keys_still_works(s3env):
    from sftjob_trainer.storage import local_model_path

    with TinyS3({"b/models/m/config.json": b"{}", "b/models/m/sub/w.bin": b"abc", "b/models/m/dir/": b""}) as server:
        s3env(server.endpoint)
        got = Path(local_model_path("s3://b/models/m"))
    assert (got / "config.json").read_bytes() == b"{}" and (got / "sub" / "w.bin").read_bytes() == b"abc"


# --------------------------------------------------------------------------- the output store


def test_store_denied_raises_storage_denied_naming_spec_storage_uri(s3env):
    from sftjob_trainer.storage import S3Prefix

    with TinyS3(error=(403, "AccessDenied")) as server:
        root = s3env(server.endpoint)
        store = S3Prefix("s3://b/runs/x", scratch=root / "scratch")
        for op in (lambda: store.put_bytes("checkpoints/latest", b"1"), lambda: store.list("checkpoints"),
                   lambda: store.get_bytes("metrics.jsonl")):
            with pytest.raises(StorageDenied, match=r"^spec.storage.uri s3://b/runs/x: "):
                op()
        staged = root / "f"
        staged.write_bytes(b"x")
        with pytest.raises(StorageDenied, match=r"^spec.storage.uri s3://b/runs/x: "):
            store.publish_file(staged, "checkpoints/step-1/f")


def test_store_transient_failures_after_retries(s3env):
    from sftjob_trainer.storage import S3Prefix, UploadError

    with TinyS3(error=(503, "SlowDown")) as server:
        root = s3env(server.endpoint)
        store = S3Prefix("s3://b/runs/x", scratch=root / "scratch")
        with pytest.raises(UploadError, match=r"spec.storage.uri: put s3://b/runs/x/a: failed after 2 attempts"):
            store.put_bytes("a", b"1")
        with pytest.raises(StorageUnavailable, match=r"^spec.storage.uri s3://b/runs/x: .*SlowDown"):
            store.list("checkpoints")


# --------------------------------------------------------------------------- data reads


def test_data_read_refused_is_unavailable_naming_the_file_field(s3env, tmp_path):
    from sftjob_trainer.parquet import resolve_files

    s3env(closed_port_endpoint())
    pq.write_table(pa.table({"prompt": ["p"], "response": ["r"]}), tmp_path / "local.parquet")
    with pytest.raises(StorageUnavailable, match=r"^spec.data.valFiles\[1\] s3://b/d/v.parquet: "):
        resolve_files([str(tmp_path / "local.parquet"), "s3://b/d/v.parquet"], "spec.data.valFiles")


def test_data_read_denied_is_storage_denied(s3env):
    from sftjob_trainer.parquet import resolve_files

    with TinyS3(error=(403, "AccessDenied")) as server:
        s3env(server.endpoint)
        with pytest.raises(StorageDenied, match=r"^spec.data.trainFiles\[0\] s3://b/d/t.parquet: "):
            resolve_files(["s3://b/d/t.parquet"])


def test_row_group_read_throttled_is_unavailable_not_invalid_data(s3env, tmp_path):
    """The file opened fine; the store then throttles every read: retryable, not bad data."""
    from sftjob_trainer.parquet import ParquetRows

    local = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["p"] * 4, "response": ["r"] * 4}), local, row_group_size=2)
    body = local.read_bytes()
    with TinyS3({"b/d/t.parquet": body}) as server:
        s3env(server.endpoint)
        rows = ParquetRows(["s3://b/d/t.parquet"], ["prompt", "response"], ["spec.data.trainFiles[0]"])
        server.error = (503, "SlowDown")
        with pytest.raises(StorageUnavailable, match=r"^spec.data.trainFiles\[0\] s3://b/d/t.parquet: .*row group"):
            rows.row(0)


# --------------------------------------------------------------------------- the trainer's exit


def run_trainer(assets: Path, tmp_path: Path, endpoint: str) -> tuple[runner.Result, str]:
    out, term = tmp_path / "out", tmp_path / "termination-log"
    args = runner.base_args(assets, out, **{"model.path": "s3://b/models/m"})
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "SFTJOB_S3_ATTEMPTS": "2",
           "SFTJOB_MODEL_CACHE": str(tmp_path / "models"), "SFTJOB_TERMINATION_LOG": str(term)}
    result = runner.run(args, out, timeout=300, extra_env=env)
    return result, term.read_text() if term.exists() else ""


def test_trainer_exits_1_when_the_model_endpoint_refuses_connections(assets, tmp_path):
    result, term = run_trainer(assets, tmp_path, closed_port_endpoint())
    assert result.code == 1, result.output
    assert term.startswith("StorageUnavailable: spec.model.path s3://b/models/m: "), term


def test_trainer_exits_2_naming_spec_model_path_for_an_empty_prefix(assets, tmp_path):
    with TinyS3({"b/models/elsewhere/config.json": b"{}"}) as server:
        result, term = run_trainer(assets, tmp_path, server.endpoint)
    assert result.code == 2, result.output
    assert term.startswith("InvalidConfig: spec.model.path s3://b/models/m: no objects under this prefix"), term
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in result.output + term
