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
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

# The S3 side lives in its own modules (one job each); these names are the storage API.
from .modelcache import local_model_path
from .nodecopy import InPlace, LocalFiles
from .s3store import S3Prefix, UploadError, fetch_once, is_s3, local_root, split_s3

__all__ = ["LocalDir", "S3Prefix", "Store", "UploadError", "atomic_write", "fetch_once", "fresh_dir", "is_s3",
           "local_model_path", "local_root", "open_store", "split_s3"]


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

    def get_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """The object's bytes and version tag (an ETag); None when there is none."""

    def put_if(self, rel: str, body: bytes, tag: str | None) -> bool:
        """A conditional write: only if the object is still at ``tag`` (None: only if it
        does not exist); False when it is not. What fencing (fence.py) stands on."""

    def read_dir(self, rel: str, key: str) -> contextlib.AbstractContextManager[LocalFiles]:
        """``rel/``'s files on local disk while the context lasts, each fetched when asked for
        (one copy per node and ``key``, holding what the node's ranks asked for; no copy at
        all for a local store)."""


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


def _sizes(base: Path) -> dict[str, int]:
    """Every regular file under ``base`` with its size, in path order. A file that is
    renamed or removed while we look (a peer's atomic write landing, a prune) is left
    out: the listing is a snapshot, and ranks write beside each other all the time."""
    found: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(base):  # a directory gone mid-walk is skipped
        for name in names:
            path = Path(dirpath, name)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[str(path.relative_to(base))] = st.st_size
    return dict(sorted(found.items()))


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

    def publish_dir(self, staged: Path, rel: str, deadline: float | None = None,
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

    def publish_file(self, staged: Path, rel: str, deadline: float | None = None) -> None:
        target = self.root / rel
        if staged.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(staged, target)

    def put_bytes(self, rel: str, body: bytes, deadline: float | None = None) -> None:
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
        return _sizes(base)

    def delete_dir(self, rel: str) -> None:
        shutil.rmtree(self.root / rel, ignore_errors=True)

    def get_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """The bytes and a version tag (their digest), as an ETag would be; None: absent."""
        body = self.get_bytes(rel)
        return None if body is None else (body, hashlib.sha256(body).hexdigest())

    def put_if(self, rel: str, body: bytes, tag: str | None) -> bool:
        """Write only if the object is still at ``tag`` (None: absent), under an exclusive
        lock, so it is a compare-and-swap for every process that shares the directory
        (flock: a node-local disk; not every network file system honours it)."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.get_tagged(rel)
            if (current[1] if current else None) != tag:
                return False
            atomic_write(path, body)
            return True

    @contextlib.contextmanager
    def read_dir(self, rel: str, key: str) -> Iterator[LocalFiles]:
        yield InPlace(self.root / rel)


# --------------------------------------------------------------------------- conformance

# Static checks, enforced by mypy (tests/test_lint.py): each implementation is a Store, so a
# method whose signature drifts from the protocol fails the lint here, not in a run on S3.
_LOCAL_DIR_IS_A_STORE: type[Store] = LocalDir
_S3_PREFIX_IS_A_STORE: type[Store] = S3Prefix
