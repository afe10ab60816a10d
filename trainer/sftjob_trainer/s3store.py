"""Objects under an s3:// prefix (boto3): the S3 side of the ``Store`` protocol and the
per-node download of a prefix (a model, a checkpoint to restore).

Every request is retried while its failure is transient and refused at once when it is
permanent (``s3errors``); what ends the run names the spec field the URI came from.
"""
from __future__ import annotations

import builtins  # `list` is a method of S3Prefix: its annotations say builtins.list
import contextlib
import fcntl
import hashlib
import logging
import os
import posixpath
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from sftjob_contract import env as E

from . import s3errors
from .errors import InvalidConfig
from .nodecopy import NodeCopy
from .s3settings import S3Settings

log = logging.getLogger(__name__)
# What each download cost, on every rank: the others log only warnings (cli.setup_logging), but
# what a node fetched (model, checkpoint ranges) is the node's own, and sizes its scratch disk.
downloads = logging.getLogger("sftjob_trainer.downloads")
downloads.setLevel(logging.INFO)

STORAGE_FIELD = "spec.storage.uri"


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


def local_root(output_dir: str) -> Path:
    """Node-local scratch space for an s3:// output (staging checkpoints and exports)."""
    base = Path(os.environ.get(E.LOCAL_DIR) or "/tmp/sftjob")
    return base / hashlib.sha256(output_dir.encode()).hexdigest()[:16]


class UploadError(RuntimeError):
    """An object could not be written within its retries and deadline (a transient cause)."""


class EmptyPrefix(FileNotFoundError):
    """Nothing to download under a prefix."""


def confined(dest: Path, name: str) -> Path:
    """Where object ``name`` (a key relative to the downloaded prefix) goes under ``dest``.

    A key is chosen by whoever can write the bucket: one rooted at "/" or holding ".." would
    otherwise be written anywhere the trainer may write."""
    parts = name.split("/")
    target = os.path.normpath(dest / name)
    if (name.startswith("/") or ".." in parts
            or os.path.commonpath([target, os.path.normpath(dest)]) != os.path.normpath(dest)):
        raise ValueError(name)
    return Path(target)


class S3Prefix:
    """Objects under one s3://bucket/prefix, with bounded retries and deadlines.

    botocore retries each request a few times on its own (jittered backoff); on top of that
    every operation is retried ``attempts`` times with a longer jittered backoff, and an
    upload has a deadline, so a stalled store fails the operation loudly instead of hanging.
    ``field`` is the spec field the URI came from, for the messages.
    """

    def __init__(self, uri: str, attempts: int | None = None, deadline_s: float = 600.0, workers: int = 8,
                 scratch: Path | None = None, field: str = STORAGE_FIELD, settings: S3Settings | None = None):
        from boto3.s3.transfer import TransferConfig

        self.bucket, prefix = split_s3(uri.rstrip("/"))
        self.prefix = prefix.rstrip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        # Read now, not cached: a later change of AWS_* (a rotated Secret, another store) counts.
        settings = settings or S3Settings.from_env()
        self.attempts = attempts or settings.store_attempts()
        self.deadline_s, self.workers, self.field = deadline_s, workers, field
        self.client = settings.boto3_client()
        self.transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
        self.scratch = scratch or local_root(self.uri)  # node-local staging for what gets uploaded

    def key(self, rel: str) -> str:
        rel = rel.strip("/")
        return "/".join(p for p in (self.prefix, rel) if p)

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
    def read_dir(self, rel: str, key: str) -> Iterator[NodeCopy]:
        # Keyed (by the run's attempt), so a copy left on the node by an earlier run is never reused.
        # Nothing is fetched yet: each rank asks for what it reads (nodecopy.py).
        try:
            yield NodeCopy(self, rel, self.scratch / "restore" / key / rel)
        finally:
            shutil.rmtree(self.scratch / "restore" / key, ignore_errors=True)

    def _retry(self, what: str, fn, deadline: float | None = None, upload: bool = False):
        """``fn()``, retried while it fails for a reason that may pass.

        A permanent failure raises ``StorageDenied`` at once. Once the attempts or the
        deadline are spent, an upload raises ``UploadError`` (the checkpointer decides what a
        lost checkpoint means) and anything else ``StorageUnavailable``."""
        deadline = deadline or (time.monotonic() + self.deadline_s)
        for attempt in range(1, self.attempts + 1):
            if time.monotonic() > deadline:  # e.g. the stop deadline passed while this waited its turn
                raise UploadError(f"{self.field}: {what}: deadline passed before attempt {attempt}")
            try:
                return fn()
            except Exception as err:  # botocore raises many kinds
                if s3errors.is_permanent(err):
                    raise s3errors.classify(err, self.field, self.uri, what) from err
                left = deadline - time.monotonic()
                if attempt == self.attempts or left <= 0:
                    if upload:
                        raise UploadError(f"{self.field}: {what}: failed after {attempt} attempts: "
                                          f"{s3errors.describe(err)}") from err
                    raise s3errors.classify(err, self.field, self.uri, what, tries=attempt) from err
                wait = min(s3errors.backoff(attempt), max(left, 0))
                log.warning("%s: attempt %d failed (%s); retrying in %.1fs", what, attempt, s3errors.describe(err),
                            wait)
                time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def upload_file(self, local: Path, rel: str, deadline: float | None = None) -> None:
        self._retry(f"upload {self.uri}/{rel}",
                    lambda: self.client.upload_file(str(local), self.bucket, self.key(rel), Config=self.transfer),
                    deadline, upload=True)

    def upload_dir(self, local: Path, rel: str, deadline: float | None = None) -> dict[str, int]:
        """Upload every file under ``local`` to ``rel/``, in parallel; returns {path: size}."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(lambda p: self.upload_file(p, f"{rel}/{p.relative_to(local)}", deadline), files))
        return {str(p.relative_to(local)): p.stat().st_size for p in files}

    def put_bytes(self, rel: str, body: bytes, deadline: float | None = None) -> None:
        self._retry(f"put {self.uri}/{rel}",
                    lambda: self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body), deadline,
                    upload=True)

    def get_bytes(self, rel: str) -> bytes | None:
        def get() -> bytes | None:
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            except self.client.exceptions.NoSuchKey:
                return None
            return obj["Body"].read()

        return self._retry(f"get {self.uri}/{rel}", get)

    def get_tagged(self, rel: str) -> tuple[bytes, str] | None:
        def get() -> tuple[bytes, str] | None:
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            except self.client.exceptions.NoSuchKey:
                return None
            return obj["Body"].read(), obj["ETag"]

        return self._retry(f"get {self.uri}/{rel}", get)

    def put_if(self, rel: str, body: bytes, tag: str | None) -> bool:
        """S3's conditional write: If-Match the ETag read, or If-None-Match * to create."""
        condition = {"IfMatch": tag} if tag else {"IfNoneMatch": "*"}

        def put() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, **condition)
            except Exception as err:  # botocore's ClientError, by its status
                response = getattr(err, "response", None) or {}
                status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = response.get("Error", {}).get("Code")
                # 412: the object is not at that version; 409: a concurrent conditional write won.
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
            return True

        return self._retry(f"conditional put {self.uri}/{rel}", put)

    def list(self, rel: str) -> dict[str, int]:
        """{path relative to ``rel``: size} of every object under ``rel/``."""
        base = self.key(rel)
        base = base + "/" if base else ""

        def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    out[obj["Key"][len(base):]] = obj["Size"]
            return out

        return self._retry(f"list {self.uri}/{rel}".rstrip("/"), listing)

    def download_dir(self, rel: str, dest: Path) -> None:
        """Every object under ``rel/`` into ``dest``, and nothing outside it."""
        # A key ending in "/" is a folder marker some tools create: nothing to download.
        objects = {name: size for name, size in self.list(rel).items() if name and not name.endswith("/")}
        if not objects:
            raise EmptyPrefix(f"nothing under {self.uri}/{rel}".rstrip("/"))
        self.download_files(rel, objects, dest)

    def download_files(self, rel: str, sizes: dict[str, int], dest: Path) -> tuple[int, int]:
        """Objects ``rel/<name>`` (``sizes``: name -> size) into ``dest/<name>``, in parallel,
        each written under a temporary name and renamed (boto3), so a file that is there is
        whole: one already there with the size listed is not downloaded again. Returns (bytes, files)
        downloaded, and logs them (what a node pays for a restart)."""
        where = f"{self.uri}/{rel}".rstrip("/")
        targets = {}
        for name in sorted(sizes):
            try:
                targets[name] = confined(dest, name)
            except ValueError:
                raise InvalidConfig(
                    f"{self.field} {where}: object {name!r} would be written outside the download directory "
                    "(its key starts with '/' or holds '..'); nothing was downloaded. Rename or remove that object"
                ) from None
        todo = [n for n, t in targets.items() if not (t.is_file() and t.stat().st_size == sizes[n])]
        dest.mkdir(parents=True, exist_ok=True)

        def fetch(name: str) -> None:
            target = targets[name]
            target.parent.mkdir(parents=True, exist_ok=True)
            # boto3 writes to a temporary name and renames it when the download is whole.
            self._retry(f"download {where}/{name}",
                        lambda: self.client.download_file(self.bucket, self.key(posixpath.join(rel, name)),
                                                          str(target), Config=self.transfer))

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            list(pool.map(fetch, todo))
        total = sum(sizes[n] for n in todo)
        if todo:
            downloads.info("downloaded %d bytes in %d files from %s to %s (%.1fs)", total, len(todo), where, dest,
                     time.monotonic() - t0)
        return total, len(todo)

    def download_ranges(self, rel: str, name: str, ranges: builtins.list[tuple[int, int]], target: Path) -> int:
        """The byte ranges [start, end) of object ``rel/name``, written at the same offsets of
        ``target`` (created sparse: what no range covers stays a hole). Returns the bytes read."""
        where = f"{self.uri}/{rel}/{name}"
        key = self.key(posixpath.join(rel, name))
        try:
            target = confined(target.parent, target.name)
        except ValueError:
            raise InvalidConfig(f"{self.field} {where}: a checkpoint file name must not leave its directory") from None
        # Parts of at most one multipart chunk, read in parallel, as a whole-file download would be.
        step = self.transfer.multipart_chunksize
        parts = [(a, min(a + step, end)) for start, end in ranges for a in range(start, end, step)]
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)

        def get(part: tuple[int, int]) -> None:
            start, end = part

            def once() -> None:
                body = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
                pos = start
                for chunk in body.iter_chunks(8 << 20):
                    os.pwrite(fd, chunk, pos)
                    pos += len(chunk)
                if pos != end:  # the connection ended early: a retry reads the range again
                    raise ConnectionError(f"short read: {pos - start} of {end - start} bytes")

            self._retry(f"download {where} bytes {start}-{end - 1}", once)

        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                list(pool.map(get, parts))
        finally:
            os.close(fd)
        total = sum(b - a for a, b in ranges)
        downloads.info("downloaded %d bytes in %d ranges from %s to %s (%.1fs)", total, len(ranges), where, target,
                 time.monotonic() - t0)
        return total

    def delete_dir(self, rel: str) -> None:
        keys = [self.key(f"{rel}/{name}") for name in self.list(rel)]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            self._retry(f"delete {self.uri}/{rel}",
                        lambda b=batch: self.client.delete_objects(Bucket=self.bucket, Delete=b))


COMPLETE = ".sftjob-complete"


def fetch_once(uri: str, dest: Path, field: str = STORAGE_FIELD, select: Callable[[str], bool] | None = None,
               marker: str = COMPLETE) -> Path:
    """Download an s3:// prefix to ``dest`` once per node, whatever the number of local ranks.

    The first process to take the lock downloads; the others find the completion marker.
    ``select``: only the objects whose names it accepts, with a ``marker`` of their own; a
    later call for more (another ``select``, or all) downloads only what is not there yet.
    ``field``: the spec field ``uri`` came from, named by the errors.
    """
    if (dest / COMPLETE).exists() or (dest / marker).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(str(dest) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((dest / COMPLETE).exists() or (dest / marker).exists()):
            store = S3Prefix(uri, field=field)
            # A key ending in "/" is a folder marker some tools create: nothing to download.
            objects = {n: s for n, s in store.list("").items() if n and not n.endswith("/")}
            if not objects:
                raise EmptyPrefix(f"nothing under {store.uri}")
            store.download_files("", {n: s for n, s in objects.items() if select is None or select(n)}, dest)
            (dest / marker).write_text(uri + "\n")
    return dest
