"""What a node reads of a stored directory: the directory itself when it is local, or a
copy on the node's scratch disk holding only what the ranks of that node asked for.

A resume of an s3:// checkpoint used to mirror the whole ``step-N/`` prefix, every
rank's shards, onto every node: at 64 nodes each node would hold 64 times its share.
``NodeCopy`` instead fetches whole small files (``.metadata``, ``trainer_state.json``)
and, of the shard files, the byte ranges a rank's DCP load plan reads
(``checkpoint.NodeLocalReader``), at the offsets they have in the object, so DCP reads
the local file as if it were whole. Local ranks of one node share the copy: under one
file lock, each fetches only the ranges no rank of the node has fetched yet (recorded
next to the files).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

log = logging.getLogger("sftjob_trainer.downloads")  # s3store: shown on every rank

# Ranges closer than this may be read as one: a request costs about as much as reading 1 MiB.
GAP = 1 << 20
RANGES = ".sftjob-ranges.json"

Ranges = list[tuple[int, int]]  # [start, end) byte offsets


class LocalFiles(Protocol):
    """A directory's files on local disk, made present on demand."""

    dir: Path

    def fetch(self, names: Iterable[str]) -> None:
        """Make these files (paths relative to ``dir``) present whole."""

    def fetch_ranges(self, ranges: dict[str, Ranges]) -> None:
        """Make these byte ranges of these files present at their offsets (the rest of
        each file may be a hole)."""

    def sizes(self) -> dict[str, int]:
        """{file: size} of what may be fetched; {} when there is nothing to fetch."""


class InPlace:
    """Files already on a disk this process reads: nothing to fetch."""

    def __init__(self, directory: Path):
        self.dir = directory

    def fetch(self, names: Iterable[str]) -> None:
        pass

    def fetch_ranges(self, ranges: dict[str, Ranges]) -> None:
        pass

    def sizes(self) -> dict[str, int]:
        return {}


class RangeSource(Protocol):
    """The store side of a ``NodeCopy`` (s3store.S3Prefix)."""

    uri: str

    def list(self, rel: str) -> dict[str, int]: ...

    def download_files(self, rel: str, sizes: dict[str, int], dest: Path) -> tuple[int, int]: ...

    def download_ranges(self, rel: str, name: str, ranges: Ranges, target: Path) -> int: ...


class NodeCopy:
    """The objects under ``rel/`` of ``source``, fetched into ``directory`` as they are asked for."""

    def __init__(self, source: RangeSource, rel: str, directory: Path):
        self.source, self.rel, self.dir = source, rel, directory
        self._sizes: dict[str, int] | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(f"{self.dir}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def sizes(self) -> dict[str, int]:
        if self._sizes is None:
            self._sizes = self.source.list(self.rel)
        return self._sizes

    def fetch(self, names: Iterable[str]) -> None:
        names = sorted(set(names))
        if all((self.dir / n).is_file() for n in names):
            return  # whole (downloads are renamed in place): no wait for the lock a prefetch holds
        sizes = self.sizes()
        absent = [n for n in names if n not in sizes]
        if absent:
            raise FileNotFoundError(f"{self.source.uri}/{self.rel}: no object {', '.join(absent)}")
        with self._locked():  # a file already present (whole: downloads are renamed in place) is skipped
            self.source.download_files(self.rel, {n: sizes[n] for n in names}, self.dir)

    def fetch_ranges(self, ranges: dict[str, Ranges]) -> None:
        with self._locked():
            record = self.dir / RANGES
            have: dict[str, Ranges] = {k: [tuple(r) for r in v] for k, v in
                                       (json.loads(record.read_text()) if record.exists() else {}).items()}
            fetched = 0
            for name in sorted(ranges):
                need = missing(merge(ranges[name], GAP), have.get(name, []))
                if not need:
                    continue
                fetched += self.source.download_ranges(self.rel, name, need, self.dir / name)
                have[name] = merge(have.get(name, []) + need, 0)
            record.write_text(json.dumps(have))
        if fetched:
            log.info("this node now holds %d of the checkpoint's bytes under %s", _held(have), self.dir)


def merge(ranges: Iterable[tuple[int, int]], gap: int) -> Ranges:
    """Sorted, non-empty ranges; overlapping or adjacent ones joined, and so are two at most
    ``gap`` apart when the gap is no longer than either of them (what is read and not wanted
    never exceeds what is wanted: small chunks a rank shares with every other, such as the
    optimizer's step counts, lie between the other ranks' shards and must not pull them in)."""
    out: Ranges = []
    for start, end in sorted((a, b) for a, b in ranges if b > a):
        hole = start - out[-1][1] if out else 0
        if out and (hole <= 0 or hole <= min(gap, out[-1][1] - out[-1][0], end - start)):
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def missing(want: Ranges, have: Ranges) -> Ranges:
    """The parts of ``want`` that no range of ``have`` covers (both sorted and disjoint)."""
    out: Ranges = []
    for start, end in want:
        pos = start
        for a, b in have:
            if b <= pos or a >= end:
                continue
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < end:
            out.append((pos, end))
    return out


def _held(have: dict[str, Ranges]) -> int:
    return sum(b - a for rs in have.values() for a, b in rs)
