"""pyarrow's filesystem for the parquet data: local paths, or s3:// through one shared client."""
from __future__ import annotations

import os
from functools import lru_cache
from urllib.parse import urlparse

from pyarrow import fs as pafs

from . import s3errors
from .s3store import is_s3, split_s3


@lru_cache(maxsize=1)
def _s3_filesystem() -> pafs.S3FileSystem:
    # Standard AWS_* variables; AWS_ENDPOINT_URL points at S3-compatible stores (MinIO).
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    kwargs = {}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or endpoint
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    # The data is read through this client while training runs (parquet is streamed by row
    # group): an S3 blip must not fail the run. pyarrow's default gives up after 3 attempts a
    # few ms apart; its AWS strategy retries connection errors, 5xx and throttling with
    # exponential backoff from 25 ms (10 attempts: about 25 s), then the error is classified
    # by s3errors like every other S3 failure.
    kwargs["retry_strategy"] = pafs.AwsDefaultS3RetryStrategy(max_attempts=s3errors.attempts(default=10))
    return pafs.S3FileSystem(**kwargs)


def parquet_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or s3:// URI."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return _s3_filesystem(), f"{bucket}/{key}"
    return pafs.LocalFileSystem(), os.path.abspath(uri)
