"""Where bytes live: a local directory or an s3:// prefix, behind one ``Store`` protocol.

Everything that reads or writes outside the process goes through here, so the rest of
the trainer never branches on the URI scheme: ``open_store`` is the one place that does.
Files are produced on local disk first (``local_path``) and then published under the same
relative path; for a local store without scratch space ``local_path`` is the target itself
and publishing only lists what is there.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import ContextManager, Protocol
from urllib.parse import urlparse

from pyarrow import fs as pafs

from sftjob_contract import env as E

log = logging.getLogger(__name__)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


S3_READ_ATTEMPTS = 10


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
    # The model and the data are read through this client while training runs (parquet is
    # streamed by row group): an S3 blip must not fail the run. pyarrow's default gives up
    # after 3 attempts a few ms apart; 10 attempts with exponential backoff from 25 ms wait
    # about 25 s for the store to answer, then fail with its error.
    kwargs["retry_strategy"] = pafs.AwsDefaultS3RetryStrategy(max_attempts=S3_READ_ATTEMPTS)
    return pafs.S3FileSystem(**kwargs)


def parquet_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or s3:// URI."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return _s3_filesystem(), f"{bucket}/{key}"
    return pafs.LocalFileSystem(), os.path.abspath(uri)


# --------------------------------------------------------------------------- the protocol


class Store(Protocol):
    """Objects under one root, addressed by paths relative to it ("checkpoints/step-3/x").

    ``deadline`` (a ``time.monotonic()`` time) bounds a write's retries; a store that
    cannot hang may ignore it.
    """

    uri: str

    def local_path(self, rel: str, rank: int | None = None) -> Path:
        """Where this process writes what it will publish at ``rel`` (per ``rank`` when
        ranks of one node must not share the directory). Nothing is created."""

    def publish_dir(self, staged: Path, rel: str, deadline: float | None = None,
                    replace: bool = False) -> dict[str, int]:
        """Make ``staged``'s files the objects under ``rel/`` (``replace``: drop what else
        was there) and give up ``staged``; returns {path under rel: size}."""

    def publish_file(self, staged: Path, rel: str, deadline: float | None = None) -> None:
        """Copy one local file to ``rel``; ``staged`` stays."""

    def put_bytes(self, rel: str, body: bytes, deadline: float | None = None) -> None: ...

    def get_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, None when there is none."""

    def list(self, rel: str) -> dict[str, int]:
        """{path relative to ``rel``: size} of every object under ``rel/``."""

    def delete_dir(self, rel: str) -> None: ...

    def read_dir(self, rel: str, key: str) -> ContextManager[Path]:
        """A local directory holding ``rel/`` while the context lasts (one copy per node and
        ``key``; no copy at all for a local store)."""


def open_store(uri: str, deadline_s: float = 600.0) -> Store:
    """The store for a ``trainer.output_dir``: the one place that looks at the scheme."""
    return S3Prefix(uri, deadline_s=deadline_s) if is_s3(uri) else LocalDir(Path(uri))


def fresh_dir(path: Path) -> Path:
    """``path`` as an empty directory. Every rank may call it at once on a shared path,
    provided none writes there before they all returned (a barrier)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a local directory


class LocalDir:
    """A local (or shared) directory as a Store.

    Without ``scratch`` files are written in place, so publishing costs nothing. With it,
    each rank stages under ``scratch/rank-<r>`` and publishing moves the files over, just
    as an S3 upload would: the tests run the S3 checkpoint logic this way.
    """

    def __init__(self, root: Path, scratch: Path | None = None):
        self.root, self.scratch = Path(root), scratch
        self.uri = str(root).rstrip("/")

    def local_path(self, rel: str, rank: int | None = None) -> Path:
        if self.scratch is None:
            return self.root / rel
        return self.scratch / (rel if rank is None else f"rank-{rank}/{rel}")

    def publish_dir(self, staged: Path, rel: str, deadline: float | None = None,  # noqa: ARG002
                    replace: bool = False) -> dict[str, int]:
        target = self.root / rel
        if staged.resolve() == target.resolve():
            return self.list(rel)
        if replace:
            shutil.rmtree(target, ignore_errors=True)
        files = sorted(p for p in staged.rglob("*") if p.is_file())
        published = {str(f.relative_to(staged)): f.stat().st_size for f in files}  # this rank's, not its peers'
        for f in files:
            dest = target / f.relative_to(staged)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
        shutil.rmtree(staged, ignore_errors=True)
        return published

    def publish_file(self, staged: Path, rel: str, deadline: float | None = None) -> None:  # noqa: ARG002
        target = self.root / rel
        if staged.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(staged, target)

    def put_bytes(self, rel: str, body: bytes, deadline: float | None = None) -> None:  # noqa: ARG002
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, body)

    def get_bytes(self, rel: str) -> bytes | None:
        path = self.root / rel
        return path.read_bytes() if path.is_file() else None

    def list(self, rel: str) -> dict[str, int]:
        base = self.root / rel
        if not base.is_dir():
            return {}
        return {str(p.relative_to(base)): p.stat().st_size for p in sorted(base.rglob("*")) if p.is_file()}

    def delete_dir(self, rel: str) -> None:
        shutil.rmtree(self.root / rel, ignore_errors=True)

    @contextlib.contextmanager
    def read_dir(self, rel: str, key: str) -> Iterator[Path]:  # noqa: ARG002
        yield self.root / rel


# --------------------------------------------------------------------------- S3 objects


class UploadError(RuntimeError):
    """An object could not be written within its retries and deadline."""


class S3Prefix:
    """Objects under one s3://bucket/prefix, with bounded retries and deadlines.

    botocore retries each request a few times on its own; on top of that every upload
    has a deadline, so a stalled store fails the operation loudly instead of hanging.
    """

    def __init__(self, uri: str, attempts: int = 5, deadline_s: float = 600.0, workers: int = 8,
                 scratch: Path | None = None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, prefix = split_s3(uri.rstrip("/"))
        self.prefix = prefix.rstrip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.attempts, self.deadline_s, self.workers = attempts, deadline_s, workers
        self.client = boto3.client(
            "s3",
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60),
        )
        self.transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
        self.scratch = scratch or local_root(self.uri)  # node-local staging for what gets uploaded

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    # The Store protocol on top of the object operations below.

    def local_path(self, rel: str, rank: int | None = None) -> Path:
        return self.scratch / (rel if rank is None else f"rank-{rank}/{rel}")

    def publish_dir(self, staged: Path, rel: str, deadline: float | None = None,
                    replace: bool = False) -> dict[str, int]:
        if replace:
            self.delete_dir(rel)
        files = self.upload_dir(staged, rel, deadline)
        shutil.rmtree(staged, ignore_errors=True)
        return files

    def publish_file(self, staged: Path, rel: str, deadline: float | None = None) -> None:
        self.upload_file(staged, rel, deadline)

    @contextlib.contextmanager
    def read_dir(self, rel: str, key: str) -> Iterator[Path]:
        # Keyed (by the run's attempt), so a copy left on the node by an earlier run is never reused.
        dest = fetch_once(f"{self.uri}/{rel}", self.scratch / "restore" / key / rel)
        try:
            yield dest
        finally:
            shutil.rmtree(self.scratch / "restore" / key, ignore_errors=True)

    def _retry(self, what: str, fn, deadline: float | None = None):
        deadline = deadline or (time.monotonic() + self.deadline_s)
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            if time.monotonic() > deadline:  # e.g. the stop deadline passed while this waited its turn
                raise UploadError(f"{what}: deadline passed before attempt {attempt}")
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - botocore raises many kinds
                left = deadline - time.monotonic()
                if attempt == self.attempts or left <= 0:
                    raise UploadError(f"{what}: failed after {attempt} attempts: {err}") from err
                log.warning("%s: attempt %d failed (%s); retrying in %.1fs", what, attempt, err, min(delay, left))
                time.sleep(min(delay, max(left, 0)))
                delay *= 2

    def upload_file(self, local: Path, rel: str, deadline: float | None = None) -> None:
        self._retry(f"upload {self.uri}/{rel}",
                    lambda: self.client.upload_file(str(local), self.bucket, self.key(rel), Config=self.transfer),
                    deadline)

    def upload_dir(self, local: Path, rel: str, deadline: float | None = None) -> dict[str, int]:
        """Upload every file under ``local`` to ``rel/``, in parallel; returns {path: size}."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(lambda p: self.upload_file(p, f"{rel}/{p.relative_to(local)}", deadline), files))
        return {str(p.relative_to(local)): p.stat().st_size for p in files}

    def put_bytes(self, rel: str, body: bytes, deadline: float | None = None) -> None:
        self._retry(f"put {self.uri}/{rel}",
                    lambda: self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body), deadline)

    def get_bytes(self, rel: str) -> bytes | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
        except self.client.exceptions.NoSuchKey:
            return None
        return obj["Body"].read()

    def list(self, rel: str) -> dict[str, int]:
        """{path relative to ``rel``: size} of every object under ``rel/``."""
        base = self.key(rel).rstrip("/") + "/"
        out: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(base):]] = obj["Size"]
        return out

    def download_dir(self, rel: str, dest: Path) -> None:
        objects = self.list(rel)
        if not objects:
            raise FileNotFoundError(f"nothing under {self.uri}/{rel}")
        dest.mkdir(parents=True, exist_ok=True)

        def fetch(name: str) -> None:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            self._retry(f"download {self.uri}/{rel}/{name}",
                        lambda: self.client.download_file(self.bucket, self.key(f"{rel}/{name}"), str(target)))

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(fetch, sorted(objects)))

    def delete_dir(self, rel: str) -> None:
        keys = [self.key(f"{rel}/{name}") for name in self.list(rel)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


def local_root(output_dir: str) -> Path:
    """Node-local scratch space for an s3:// output (staging checkpoints and exports)."""
    base = Path(os.environ.get(E.LOCAL_DIR) or "/tmp/sftjob")
    return base / hashlib.sha256(output_dir.encode()).hexdigest()[:16]


def fetch_once(uri: str, dest: Path) -> Path:
    """Download an s3:// prefix to ``dest`` once per node, whatever the number of local ranks.

    The first process to take the lock downloads; the others find the completion marker.
    """
    done = dest / ".sftjob-complete"
    if done.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(str(dest) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            log.info("downloading %s to %s", uri, dest)
            _download_prefix(uri, dest)
            done.write_text(uri + "\n")
    return dest


def _download_prefix(uri: str, dest: Path) -> None:
    bucket, key = split_s3(uri.rstrip("/"))
    parent, _, leaf = key.rpartition("/")
    store = S3Prefix(f"s3://{bucket}/{parent}" if parent else f"s3://{bucket}")
    store.download_dir(leaf, dest)


def local_model_path(path: str) -> str:
    """A local directory holding the model: ``path`` itself, or a per-node cache of an s3:// prefix."""
    if not is_s3(path):
        return path
    cache = Path(os.environ.get(E.MODEL_CACHE) or "/tmp/sftjob-models")
    return str(fetch_once(path, cache / hashlib.sha256(path.encode()).hexdigest()[:16]))
