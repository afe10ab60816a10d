"""One S3 settings object (issue 24): every S3 client the trainer makes (the output and
checkpoint store, the model download, the data filesystem) is built from it, it reads the
pod's environment, and its secrets never show in a repr."""
from __future__ import annotations

import pytest

from sftjob_trainer import parquetfs
from sftjob_trainer.s3settings import DATA_ATTEMPTS, DEFAULT_ATTEMPTS, S3Settings
from sftjob_trainer.s3store import S3Prefix

pytestmark = pytest.mark.unit

ENV = {"AWS_ENDPOINT_URL": "http://minio.example:9000", "AWS_DEFAULT_REGION": "eu-west-3",
       "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "AWS_SESSION_TOKEN": "t0ken-value"}


def test_settings_come_from_the_environment_and_hide_the_secrets():
    s = S3Settings.from_env(ENV)
    assert (s.endpoint, s.region, s.access_key_id, s.attempts) == (
        "http://minio.example:9000", "eu-west-3", "AKIDEXAMPLE", None)
    assert S3Settings.from_env({**ENV, "AWS_REGION": "us-east-2"}).region == "us-east-2"  # AWS_REGION wins
    shown = repr(s)
    assert "s3cr3t" not in shown and "t0ken" not in shown and "AKID" not in shown, shown
    assert (s.store_attempts(), s.data_attempts()) == (DEFAULT_ATTEMPTS, DATA_ATTEMPTS)
    five = S3Settings.from_env({"SFTJOB_S3_ATTEMPTS": "5"})
    assert (five.store_attempts(), five.data_attempts()) == (5, 5)
    assert S3Settings.from_env({"SFTJOB_S3_ATTEMPTS": "many"}).attempts is None


def test_the_store_and_the_data_filesystem_are_built_from_the_same_settings(monkeypatch):
    for k in list(ENV) + ["AWS_REGION", "AWS_ENDPOINT_URL_S3", "SFTJOB_S3_ATTEMPTS"]:
        monkeypatch.delenv(k, raising=False)
    for k, v in {**ENV, "SFTJOB_S3_ATTEMPTS": "4"}.items():
        monkeypatch.setenv(k, v)
    store = S3Prefix("s3://bucket/prefix")
    assert store.client.meta.endpoint_url == "http://minio.example:9000"
    assert store.client.meta.region_name == "eu-west-3"
    assert store.attempts == 4
    creds = store.client._request_signer._credentials
    assert (creds.access_key, creds.token) == ("AKIDEXAMPLE", "t0ken-value")
    parquetfs._s3_filesystem.cache_clear()
    fs, path = parquetfs.parquet_filesystem("s3://bucket/data/train.parquet")
    assert path == "bucket/data/train.parquet" and fs.region == "eu-west-3"
    # Rotated credentials (a new Secret) get a client of their own, not the cached one.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    assert parquetfs.parquet_filesystem("s3://bucket/x.parquet")[0] is not fs
    assert S3Prefix("s3://bucket/prefix").client._request_signer._credentials.secret_key == "rotated"


def test_without_static_keys_each_sdk_keeps_its_default_credential_chain(monkeypatch):
    """Passing empty keys would switch off web identity (IRSA) and instance roles."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    assert S3Settings.from_env({"AWS_REGION": "us-east-1"})._static_keys() == {}
    assert S3Settings.from_env({"AWS_ACCESS_KEY_ID": "only-the-id"})._static_keys() == {}
