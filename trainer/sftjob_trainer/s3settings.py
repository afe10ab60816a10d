"""How the trainer talks to object storage: one settings object, read from the environment once
per client, from which every S3 client is built (the checkpoint and output store and the model
download in s3store.py through boto3; the parquet/JSONL data in parquetfs.py through pyarrow).

The pod's environment is the only source (the operator maps the Secret named by
`spec.storage.credentialsSecretRef` into it): the endpoint and region, the static credentials
when they are set, and SFTJOB_S3_ATTEMPTS. Without static credentials each SDK resolves them by
its default chain (web identity for IRSA, instance roles), which passing keys would disable.
The secret fields never appear in a repr or a log.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from sftjob_contract import env as E

DEFAULT_ATTEMPTS = 8       # per store operation (s3store's retry loop): about 40 s of outage
DATA_ATTEMPTS = 10         # per data read (pyarrow's AWS strategy, from 25 ms): about 25 s
REQUEST_ATTEMPTS = 3       # botocore's own, inside each store attempt


@dataclass(frozen=True)
class S3Settings:
    """Endpoint, region, credentials, retries and timeouts of every S3 client the trainer makes."""

    endpoint: str | None = None         # AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3): MinIO and others
    region: str | None = None           # AWS_REGION, else AWS_DEFAULT_REGION
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    attempts: int | None = None         # SFTJOB_S3_ATTEMPTS; None: each client's default above
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Settings:
        env = os.environ if environ is None else environ
        raw = env.get(E.S3_ATTEMPTS, "")
        try:
            attempts = max(1, int(raw)) if raw else None
        except ValueError:
            attempts = None
        return cls(endpoint=env.get(E.AWS_ENDPOINT_URL) or env.get("AWS_ENDPOINT_URL_S3") or None,
                   region=env.get(E.AWS_REGION) or env.get(E.AWS_DEFAULT_REGION) or None,
                   access_key_id=env.get(E.AWS_ACCESS_KEY_ID) or None,
                   secret_access_key=env.get(E.AWS_SECRET_ACCESS_KEY) or None,
                   session_token=env.get(E.AWS_SESSION_TOKEN) or None, attempts=attempts)

    def store_attempts(self) -> int:
        return self.attempts or DEFAULT_ATTEMPTS

    def data_attempts(self) -> int:
        return self.attempts or DATA_ATTEMPTS

    def _static_keys(self) -> dict[str, str]:
        if not (self.access_key_id and self.secret_access_key):
            return {}
        keys = {"access_key": self.access_key_id, "secret_key": self.secret_access_key}
        return {**keys, "session_token": self.session_token} if self.session_token else keys

    def boto3_client(self) -> Any:
        """An S3 client of a session of its own (the default session caches the credentials it
        first resolved, so a rotated Secret would go unseen)."""
        import boto3
        from botocore.config import Config

        keys = self._static_keys()
        session = boto3.session.Session(aws_access_key_id=keys.get("access_key"),
                                        aws_secret_access_key=keys.get("secret_key"),
                                        aws_session_token=keys.get("session_token"), region_name=self.region)
        config = Config(retries={"total_max_attempts": min(REQUEST_ATTEMPTS, self.store_attempts()),
                                 "mode": "standard"},
                        connect_timeout=self.connect_timeout_s, read_timeout=self.read_timeout_s)
        return session.client("s3", endpoint_url=self.endpoint, config=config)

    def arrow_filesystem(self) -> Any:
        """pyarrow's S3 filesystem. The data is streamed by row group while training runs, so an
        S3 blip must not fail the run: pyarrow's default gives up after 3 attempts a few ms
        apart; its AWS strategy retries connection errors, 5xx and throttling with exponential
        backoff, then the error is classified by s3errors like every other S3 failure."""
        from pyarrow import fs as pafs

        kwargs: dict[str, Any] = dict(self._static_keys())
        if self.endpoint:
            parsed = urlparse(self.endpoint)
            kwargs["endpoint_override"] = parsed.netloc or self.endpoint
            kwargs["scheme"] = parsed.scheme or "https"
        if self.region:
            kwargs["region"] = self.region
        return pafs.S3FileSystem(retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=self.data_attempts()),
                                 connect_timeout=self.connect_timeout_s, request_timeout=self.read_timeout_s,
                                 **kwargs)
