"""Where bytes live: a local directory or an s3:// prefix.

Everything that reads or writes outside the process goes through here, so the rest of
the trainer never branches on the URI scheme.
"""
from __future__ import annotations

import os
from functools import lru_cache
from urllib.parse import urlparse

from pyarrow import fs as pafs


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


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
    return pafs.S3FileSystem(**kwargs)


def parquet_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or s3:// URI."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return _s3_filesystem(), f"{bucket}/{key}"
    return pafs.LocalFileSystem(), os.path.abspath(uri)
