"""pyarrow's filesystem for the parquet data: local paths, or s3:// through one shared client
built from the S3 settings (s3settings.py)."""
from __future__ import annotations

import os
from functools import lru_cache

from pyarrow import fs as pafs

from .s3settings import S3Settings
from .s3store import is_s3, split_s3


@lru_cache(maxsize=4)
def _s3_filesystem(settings: S3Settings) -> pafs.S3FileSystem:
    # One client per distinct settings: the environment is read for each URI, so rotated
    # credentials get a client of their own.
    return settings.arrow_filesystem()


def parquet_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or s3:// URI."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return _s3_filesystem(S3Settings.from_env()), f"{bucket}/{key}"
    return pafs.LocalFileSystem(), os.path.abspath(uri)
