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

from .errors import InvalidData
from .storage import is_s3, parquet_filesystem


def resolve_files(patterns: list[str]) -> list[str]:
    """Expand paths, directories and globs (local or s3://) into a sorted file list."""
    files: list[str] = []
    for pattern in patterns:
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
                raise InvalidData(f"no files match {pattern}")
            files += [prefix + f for f in found]
            continue
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory or (prefix and info.type == pafs.FileType.NotFound and path.endswith("/")):
            infos = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
            if not found:
                raise InvalidData(f"no .parquet files under {pattern}")
            files += [prefix + f for f in found]
        elif info.type == pafs.FileType.File:
            files.append(pattern)
        else:
            raise InvalidData(f"data file {pattern} does not exist")
    return files


class ParquetRows:
    """Random access to rows of several parquet files, one cached row group at a time."""

    def __init__(self, files: list[str], columns: list[str]):
        self.files = files
        self.columns = columns
        self._handles: dict[int, pq.ParquetFile] = {}
        groups: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        for fi, f in enumerate(files):
            pf = self._open(fi)
            names = set(pf.schema_arrow.names)
            missing = [c for c in columns if c not in names]
            if missing:
                raise InvalidData(
                    f"{f}: missing column(s) {', '.join(missing)} (has: {', '.join(sorted(names)) or 'none'}); "
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
            except (pa.ArrowInvalid, OSError) as err:
                raise InvalidData(f"{self.files[fi]}: not a readable parquet file ({err})") from None
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
            self._cache = self._open(fi).read_row_group(rg, columns=self.columns)
            self._cache_key = g
        j = index - int(self.group_start[g])
        return {c: self._cache.column(c)[j].as_py() for c in self.columns}

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
        out = []
        for f in self.files:
            fs, path = parquet_filesystem(f)
            info = fs.get_file_info(path)
            mtime = info.mtime_ns if info.mtime_ns is not None else -1
            out.append((f, int(info.size or 0), int(mtime)))
        return out

    def fingerprint(self) -> str:
        """Identifies the data (files, sizes, row counts) so a resume can refuse other data."""
        desc = [(os.path.basename(f), n) for f, n in zip(self.files, self._rows_per_file())]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def _rows_per_file(self) -> list[int]:
        counts = [0] * len(self.files)
        for fi, _, n in self.groups:
            counts[fi] += n
        return counts
