"""Parquet input: file patterns (local or s3://) → files → rows, one row group at a time.

Only the needed columns are read and never a whole file at once, so the start-up scan and
the sample reads stay light on memory however big the files are."""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from . import s3errors
from .errors import InvalidData
from .parquetfs import parquet_filesystem
from .s3store import is_s3


def _storage_or(err: Exception, field: str, uri: str, what: str, data_error: str) -> Exception:
    """The storage error ``err`` is (pyarrow already retried it), else ``InvalidData``: the
    file itself is bad, and reading it again cannot help."""
    if is_s3(uri) and s3errors.is_storage_error(err):
        return s3errors.classify(err, field, uri, what)
    return InvalidData(f"{field} {uri}: {data_error} ({err})")


def resolve_files(patterns: list[str], field: str = "spec.data.trainFiles",
                  suffixes: tuple[str, ...] = (".parquet",)) -> list[tuple[str, str]]:
    """Expand paths, directories and globs (local or s3://) into a sorted file list of
    (file, the spec field it came from: ``field[i]``); a directory contributes its files
    whose names end in one of ``suffixes``."""
    files: list[tuple[str, str]] = []
    for i, pattern in enumerate(patterns):
        where = f"{field}[{i}]"
        try:
            found = _expand(pattern, where, suffixes)
        except OSError as err:
            raise _storage_or(err, where, pattern, "listing", "cannot list") from None
        files += [(f, where) for f in found]
    return files


def _expand(pattern: str, where: str, suffixes: tuple[str, ...]) -> list[str]:
    fs, path = parquet_filesystem(pattern)
    prefix = "s3://" if is_s3(pattern) else ""
    if any(c in path for c in "*?["):
        if prefix:
            base = path.split("*")[0].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path))
        else:
            found = sorted(glob.glob(path, recursive=True))
        if not found:
            raise InvalidData(f"{where} {pattern}: no files match")
        return [prefix + f for f in found]
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory or (prefix and info.type == pafs.FileType.NotFound and path.endswith("/")):
        infos = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
        found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffixes))
        if not found:
            raise InvalidData(f"{where} {pattern}: no {' or '.join(suffixes)} files under it")
        return [prefix + f for f in found]
    if info.type == pafs.FileType.File:
        return [pattern]
    raise InvalidData(f"{where} {pattern}: data file does not exist")


def file_identity(uri: str, field: str) -> tuple[str, int, int]:
    """(path, size, mtime in ns) of one data file, for the scan cache's key."""
    fs, path = parquet_filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except OSError as err:
        raise _storage_or(err, field, uri, "stat", "cannot stat") from None
    mtime = info.mtime_ns if info.mtime_ns is not None else -1
    return (uri, int(info.size or 0), int(mtime))


class ParquetRows:
    """Random access to rows of several parquet files, one cached row group at a time."""

    def __init__(self, files: list[str], columns: list[str], fields: list[str] | None = None):
        self.files = files
        self.fields = fields or ["data file"] * len(files)  # the spec field each file came from
        self.columns = columns
        self._handles: dict[int, pq.ParquetFile] = {}
        groups: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        for fi, f in enumerate(files):
            pf = self._open(fi)
            names = set(pf.schema_arrow.names)
            missing = [c for c in columns if c not in names]
            if missing:
                raise InvalidData(
                    f"{self.fields[fi]} {f}: missing column(s) {', '.join(missing)} "
                    f"(has: {', '.join(sorted(names)) or 'none'}); "
                    "set data.prompt_key/data.response_key or data.messages_key to the right columns"
                )
            for rg in range(pf.metadata.num_row_groups):
                groups.append((fi, rg, pf.metadata.row_group(rg).num_rows))
        self.groups = groups
        self.group_start = np.concatenate([[0], np.cumsum([g[2] for g in groups], dtype=np.int64)])
        self.num_rows = int(self.group_start[-1])
        self._cache_key: int | None = None
        self._cache: pa.Table | None = None

    def _open(self, fi: int) -> pq.ParquetFile:
        pf = self._handles.get(fi)
        if pf is None:
            fs, path = parquet_filesystem(self.files[fi])
            try:
                pf = pq.ParquetFile(fs.open_input_file(path))
            except (pa.ArrowException, OSError) as err:
                raise _storage_or(err, self.fields[fi], self.files[fi], "open",
                                  "not a readable parquet file") from None
            self._handles[fi] = pf
        return pf

    def group_of(self, row: int) -> int:
        return int(np.searchsorted(self.group_start, row, side="right") - 1)

    def row(self, index: int) -> dict[str, Any]:
        g = self.group_of(index)
        if g != self._cache_key:
            fi, rg, _ = self.groups[g]
            # Kept as Arrow buffers (not Python objects): a rank holds one decompressed
            # row group at a time, whatever the size of the dataset.
            try:
                self._cache = self._open(fi).read_row_group(rg, columns=self.columns)
            except (pa.ArrowException, OSError) as err:
                raise _storage_or(err, self.fields[fi], self.files[fi], f"reading row group {rg}",
                                  f"row group {rg} is corrupt; rewrite the file or leave it out") from None
            self._cache_key = g
        table = self._cache
        assert table is not None  # set with _cache_key, which now names group g
        j = index - int(self.group_start[g])
        return {c: table.column(c)[j].as_py() for c in self.columns}

    def close(self) -> None:
        """Drop the cached row group and the open files while Arrow is fully alive.

        Arrow objects left for interpreter teardown can abort the process after a run
        that succeeded (apache/arrow#34314); a finished rank releases them here instead.
        """
        self._cache, self._cache_key = None, None
        handles, self._handles = self._handles, {}
        for pf in handles.values():
            try:
                pf.close(force=True)
            except Exception:  # noqa: BLE001 - closing is best effort; the data was already read
                pass

    def identity(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime in ns) of every file: changes whenever a file is rewritten."""
        return [file_identity(f, field) for f, field in zip(self.files, self.fields)]

    def fingerprint(self) -> str:
        """Identifies the data (files, sizes, row counts) so a resume can refuse other data."""
        desc = [(os.path.basename(f), n) for f, n in zip(self.files, self._rows_per_file())]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def _rows_per_file(self) -> list[int]:
        counts = [0] * len(self.files)
        for fi, _, n in self.groups:
            counts[fi] += n
        return counts
