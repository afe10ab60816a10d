"""JSONL input: one JSON object per line, local or s3://, read through the parquet reader's
filesystem layer (`parquetfs.py`), so credentials, endpoints and S3 retries are the same.

`JsonlRows` offers what `ParquetRows` offers (rows by index, groups of rows for a local
shuffle, identity and fingerprint), so a dataset does not care which format it reads:
- At open, each file is read once, line by line, to count its rows and note where every
  LINES_PER_GROUP-th row starts (a byte offset and a line number). Nothing else is kept.
- A row is read with its group: one ranged read of the group's bytes (a `.jsonl.gz` file
  has no random access, so it is held decompressed in memory instead; prefer plain JSONL
  for large sources).
- Blank lines are not rows. A line that is not a JSON object fails naming file:line.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from .errors import InvalidData
from .parquet import _storage_or, file_identity
from .parquetfs import parquet_filesystem

LINES_PER_GROUP = 1024   # rows read (and shuffled) together: the JSONL "row group"
READ_BLOCK = 8 << 20     # bytes per read while indexing a file
SUFFIXES = (".jsonl", ".jsonl.gz")


def is_gzip(path: str) -> bool:
    return path.endswith(".gz")


class JsonlRows:
    """Random access to the rows of several JSONL files, one cached group of lines at a time."""

    def __init__(self, files: list[str], columns: list[str], fields: list[str] | None = None):
        self.files = files
        self.fields = fields or ["data file"] * len(files)
        self.columns = columns
        self._inflated: dict[int, bytes] = {}   # .gz files, decompressed
        self._handles: dict[int, Any] = {}      # open random-access files
        # (file index, first byte, end byte, first line number, rows)
        self.groups: list[tuple[int, int, int, int, int]] = []
        for fi in range(len(files)):
            self.groups += self._index(fi)
        self.group_start = np.concatenate([[0], np.cumsum([g[4] for g in self.groups], dtype=np.int64)])
        self.num_rows = int(self.group_start[-1])
        self._cache_key: int | None = None
        self._cache: list[tuple[int, bytes]] = []

    # ------------------------------------------------------------------ reading bytes

    def _blocks(self, fi: int):
        """The file's bytes, block by block (decompressed for .gz)."""
        uri = self.files[fi]
        fs, path = parquet_filesystem(uri)
        try:
            if is_gzip(uri):
                with fs.open_input_stream(path, compression="gzip") as f:
                    self._inflated[fi] = f.read()
                yield self._inflated[fi]
                return
            with fs.open_input_stream(path, compression=None) as f:
                while block := f.read(READ_BLOCK):
                    yield block
        except (pa.ArrowException, OSError) as err:
            raise _storage_or(err, self.fields[fi], uri, "reading", "not a readable JSONL file") from None

    def _index(self, fi: int) -> list[tuple[int, int, int, int, int]]:
        """Groups of up to LINES_PER_GROUP non-blank lines of one file."""
        groups, start, first_line, rows = [], 0, 0, 0
        offset, line_no, carry = 0, 0, b""
        for block in self._blocks(fi):
            data = carry + block
            base = offset - len(carry)
            pos = 0
            while (nl := data.find(b"\n", pos)) >= 0:
                if data[pos:nl].strip():
                    if rows == 0:
                        start, first_line = base + pos, line_no
                    rows += 1
                    if rows == LINES_PER_GROUP:
                        groups.append((fi, start, base + nl + 1, first_line, rows))
                        rows = 0
                line_no += 1
                pos = nl + 1
            carry = data[pos:]
            offset += len(block)
        if carry.strip():   # a last line without a newline
            if rows == 0:
                start, first_line = offset - len(carry), line_no
            rows += 1
        if rows:
            groups.append((fi, start, offset, first_line, rows))
        return groups

    def _group_bytes(self, fi: int, start: int, end: int) -> bytes:
        if fi in self._inflated:
            return self._inflated[fi][start:end]
        uri = self.files[fi]
        try:
            f = self._handles.get(fi)
            if f is None:
                fs, path = parquet_filesystem(uri)
                f = self._handles[fi] = fs.open_input_file(path)
            return f.read_at(end - start, start)
        except (pa.ArrowException, OSError) as err:
            raise _storage_or(err, self.fields[fi], uri, f"reading bytes {start}-{end}", "cannot read") from None

    # ------------------------------------------------------------------ rows

    def group_of(self, row: int) -> int:
        return int(np.searchsorted(self.group_start, row, side="right") - 1)

    def row(self, index: int) -> dict[str, Any]:
        g = self.group_of(index)
        fi, start, end, first_line, _ = self.groups[g]
        if g != self._cache_key:
            lines = self._group_bytes(fi, start, end).split(b"\n")
            self._cache = [(first_line + k, line) for k, line in enumerate(lines) if line.strip()]
            self._cache_key = g
        line_no, raw = self._cache[index - int(self.group_start[g])]
        return self._parse(fi, line_no + 1, raw)

    def _parse(self, fi: int, line: int, raw: bytes) -> dict[str, Any]:
        where = f"{self.fields[fi]} {self.files[fi]}:{line}"
        try:
            obj = json.loads(raw)
        except ValueError as err:   # JSONDecodeError and UnicodeDecodeError
            raise InvalidData(f"{where}: not valid JSON ({err}); fix or remove the line") from None
        if not isinstance(obj, dict):
            raise InvalidData(f"{where}: a JSONL line must be a JSON object, got {type(obj).__name__}")
        missing = [c for c in self.columns if c not in obj]
        if missing:
            raise InvalidData(f"{where}: missing key(s) {', '.join(missing)} "
                              f"(has: {', '.join(sorted(obj)) or 'none'}); "
                              "set the source's prompt_key/response_key or messages_key to the right keys")
        return {c: obj[c] for c in self.columns}

    def close(self) -> None:
        self._cache, self._cache_key, self._inflated = [], None, {}
        handles, self._handles = self._handles, {}
        for f in handles.values():
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the data was already read
                pass

    def identity(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime in ns) of every file: changes whenever a file is rewritten."""
        return [file_identity(f, field) for f, field in zip(self.files, self.fields)]

    def fingerprint(self) -> str:
        """Identifies the data (files, row counts) so a resume can refuse other data."""
        counts = [0] * len(self.files)
        for fi, *_, n in self.groups:
            counts[fi] += n
        desc = [(os.path.basename(f), n) for f, n in zip(self.files, counts)]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- either format

FORMAT_SUFFIXES = {"parquet": (".parquet",), "jsonl": SUFFIXES}


def format_of(path: str) -> str | None:
    """The format a file's name says it has, or None."""
    for fmt, suffixes in FORMAT_SUFFIXES.items():
        if path.endswith(suffixes):
            return fmt
    return None


def open_rows(patterns: list[str], columns: list[str], field: str, fmt: str | None = "parquet",
              format_field: str | None = None) -> tuple[str, Any]:
    """(format, rows) of one dataset's files. ``fmt`` None: every file's name must say the same
    format (directories then contribute .parquet, .jsonl and .jsonl.gz files)."""
    from .parquet import ParquetRows, resolve_files

    suffixes = FORMAT_SUFFIXES[fmt] if fmt else tuple(s for v in FORMAT_SUFFIXES.values() for s in v)
    resolved = resolve_files(patterns, field, suffixes)
    files, fields = [f for f, _ in resolved], [w for _, w in resolved]
    if fmt is None:
        kinds = {format_of(f) for f in files}
        if len(kinds) != 1 or None in kinds:
            unknown = [f for f in files if format_of(f) is None]
            why = (f"cannot tell the format of {unknown[0]} from its name" if unknown
                   else "its files mix parquet and JSONL")
            raise InvalidData(f"{field}: {why}; set {format_field or 'the format'} to parquet or jsonl "
                              "(one format per source)")
        fmt = kinds.pop()
        assert fmt is not None  # refused above: one kind, and not None
    rows = JsonlRows(files, columns, fields) if fmt == "jsonl" else ParquetRows(files, columns, fields)
    return fmt, rows
