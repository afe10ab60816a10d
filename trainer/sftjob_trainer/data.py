"""SFT data: parquet rows → token ids with loss targets → batches in a resumable order.

Three ideas keep this exact and light on memory:
- Parquet is read one row group at a time (never a whole file), only the needed columns.
- At start-up every rank tokenizes its block of the rows once to learn which rows are
  usable and how long they are; the small table of lengths is shared by all ranks. It
  gives the truncation/drop statistics up front and lets dropped rows leave the index
  space, so the sample order is a pure function of (seed, epoch).
- The data position is one global sample cursor into that order. A rank takes its slice
  of each global batch, so a checkpoint written by N processes resumes on M processes
  with the very same samples in the same order.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs
import torch

from sftjob_contract.config import DataConfig

from . import dist as dist_utils
from .errors import InvalidData
from .storage import is_s3, parquet_filesystem

log = logging.getLogger(__name__)

IGNORE = -100

# Lengths table codes for rows that never become samples.
DROPPED_NO_TARGET = -1


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    targets: list[int]  # already shifted: targets[t] is the label for predicting input_ids[t+1]

    @property
    def n_targets(self) -> int:
        return sum(1 for t in self.targets if t != IGNORE)


# --------------------------------------------------------------------------- files


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


# --------------------------------------------------------------------------- tokenization


class SampleBuilder:
    """Turns one row into a Sample: prompt tokens masked, response/assistant tokens trained."""

    def __init__(self, tokenizer, cfg: DataConfig):
        self.tok = tokenizer
        self.cfg = cfg
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise InvalidData("the tokenizer has no eos_token; set one so the model learns to stop")
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.messages_key and not self.has_template:
            raise InvalidData("data.messages_key is set but the tokenizer has no chat_template")

    def identity(self) -> dict[str, Any]:
        """Everything that decides a row's token count: the tokenizer, its template and the
        data settings that shape a sample."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else json.dumps(sorted(self.tok.get_vocab().items()))
        return {
            "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
            "chat_template": getattr(self.tok, "chat_template", None),
            "eos": self.eos,
            "bos": getattr(self.tok, "bos_token_id", None),
            "settings": {k: getattr(self.cfg, k) for k in
                         ("prompt_key", "response_key", "messages_key", "max_length", "truncation")},
        }

    @property
    def columns(self) -> list[str]:
        if self.cfg.messages_key:
            return [self.cfg.messages_key]
        return [self.cfg.prompt_key, self.cfg.response_key]

    def build(self, row: dict[str, Any], where: str) -> tuple[Sample | None, bool]:
        """Return (sample or None when it has no trainable token, whether it was truncated)."""
        ids, mask = self._encode(row, where)
        truncated = False
        limit = self.cfg.max_length
        if len(ids) > limit:
            if self.cfg.truncation == "error":
                raise InvalidData(
                    f"{where}: {len(ids)} tokens exceed data.max_length={limit}; raise max_length or set "
                    "data.truncation to left or right"
                )
            truncated = True
            sl = slice(len(ids) - limit, None) if self.cfg.truncation == "left" else slice(0, limit)
            ids, mask = ids[sl], mask[sl]
        # Shift once here: the label of position t is token t+1 when that token is trained.
        # The first token of a sequence is never a label, so packed rows cannot leak
        # across sequence boundaries.
        targets = [ids[t + 1] if mask[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
        sample = Sample(ids, targets)
        return (sample if sample.n_targets else None), truncated

    def _encode(self, row: dict[str, Any], where: str) -> tuple[list[int], list[bool]]:
        if self.cfg.messages_key:
            messages = row[self.cfg.messages_key]
            return self._encode_chat(self._check_messages(messages, where), where)
        prompt, response = row[self.cfg.prompt_key], row[self.cfg.response_key]
        for key, value in ((self.cfg.prompt_key, prompt), (self.cfg.response_key, response)):
            if not isinstance(value, str):
                raise InvalidData(f"{where}: column {key!r} must hold strings, got {type(value).__name__}")
        if self.has_template:
            return self._encode_chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], where)
        p = self.tok(prompt, add_special_tokens=True)["input_ids"]
        r = self.tok(response, add_special_tokens=False)["input_ids"] + [self.eos]
        return p + r, [False] * len(p) + [True] * len(r)

    @staticmethod
    def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
        if not isinstance(messages, list) or not messages:
            raise InvalidData(f"{where}: messages must be a non-empty list of {{role, content}}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidData(f"{where}: every message needs string 'role' and 'content' fields")
        return messages

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode_chat(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[bool]]:
        # Render the whole conversation once and find each assistant turn's character span
        # by rendering the prefixes; tokenizing the full text once keeps merges across turn
        # boundaries identical to what the model sees at inference.
        text = self._render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self._render(messages[: i + 1], add_generation_prompt=False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise InvalidData(f"{where}: the chat template does not render conversations prefix by prefix")
            spans.append((len(before), len(upto)))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [any(s <= start < e for s, e in spans) for start, _ in offsets]
        if spans and self.eos not in [t for t, m in zip(ids, mask) if m]:
            # Templates whose assistant turn has no EOS would teach a model that never stops.
            ids, mask = ids + [self.eos], mask + [True]
        return ids, mask


# --------------------------------------------------------------------------- dataset


@dataclass(frozen=True)
class ScanStats:
    rows: int
    usable: int
    truncated: int
    dropped_no_target: int

    def describe(self, name: str) -> str:
        pct = lambda n: 100.0 * n / max(self.rows, 1)  # noqa: E731
        return (
            f"{name}: {self.rows} rows, {self.usable} usable; truncated {self.truncated} ({pct(self.truncated):.1f}%), "
            f"dropped (no trainable token) {self.dropped_no_target} ({pct(self.dropped_no_target):.1f}%)"
        )


class ScanCache(Protocol):
    """Where scans are kept between starts of one job (Outputs: next to its checkpoints)."""

    def get(self, name: str) -> bytes | None: ...

    def put(self, name: str, data: bytes) -> None: ...


def _encode_scan(lengths: np.ndarray, stats: ScanStats) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, lengths=lengths, stats=np.array([stats.rows, stats.usable, stats.truncated,
                                                   stats.dropped_no_target], dtype=np.int64))
    return buf.getvalue()


def _decode_scan(data: bytes | None, rows: int) -> tuple[np.ndarray, ScanStats] | None:
    if not data:
        return None
    try:
        with np.load(io.BytesIO(data)) as z:
            lengths, stats = z["lengths"].astype(np.int32), ScanStats(*(int(v) for v in z["stats"]))
    except Exception as err:  # noqa: BLE001 - a damaged cache entry is only a missed shortcut
        log.warning("ignoring an unreadable scan cache entry (%s)", err)
        return None
    if len(lengths) != rows or stats.rows != rows:
        return None
    return lengths, stats


class SFTDataset:
    """Rows of parquet files, scanned once, each usable row a Sample on demand."""

    def __init__(self, patterns: list[str], builder: SampleBuilder, name: str, rank: int = 0, world: int = 1,
                 cache: ScanCache | None = None):
        self.name = name
        self._rank, self._world = rank, world
        self.builder = builder
        files = resolve_files(patterns)
        self.rows = ParquetRows(files, builder.columns)
        if self.rows.num_rows == 0:
            raise InvalidData(f"{name} data ({', '.join(files)}) has no rows")
        self.lengths, self.stats = self._cached_scan(cache)
        self.valid = np.flatnonzero(self.lengths > 0)
        if len(self.valid) == 0:
            raise InvalidData(
                f"{name} data has no trainable tokens: all {self.stats.rows} rows were dropped "
                "(empty responses, or truncation removed every response token)"
            )
        log.info(self.stats.describe(name))

    def _cached_scan(self, cache: ScanCache | None) -> tuple[np.ndarray, ScanStats]:
        """The scan, or its saved result when nothing that decides it has changed.

        A restart after preemption then skips re-tokenizing the whole dataset. The key
        covers every file's size and modification time, the tokenizer and the data
        settings; a stale or unreadable entry is simply scanned again.
        """
        if cache is None:
            return self._scan()
        key, found = None, None
        if self._rank == 0:  # rank 0 alone reads and writes the cache; the others get its answer
            ident = {"v": 1, "files": self.rows.identity(), "columns": self.rows.columns,
                     "builder": self.builder.identity()}
            key = f"scan-{self.name}-{hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]}.npz"
            found = _decode_scan(cache.get(key), self.rows.num_rows)
            if found is not None:
                log.info("%s data: reusing the token-length scan %s", self.name, key)
        found = dist_utils.broadcast_object(found)
        if found is not None:
            return found
        lengths, stats = self._scan()
        if self._rank == 0:
            cache.put(key, _encode_scan(lengths, stats))
        return lengths, stats

    def _scan(self) -> tuple[np.ndarray, ScanStats]:
        rank, size = self._rank, self._world
        # A contiguous block of rows per rank: each rank reads (from S3, decompresses) only
        # the row groups of its block, not every row group for a strided share.
        mine = range(self.rows.num_rows * rank // size, self.rows.num_rows * (rank + 1) // size)
        lengths = np.zeros(len(mine), dtype=np.int32)
        truncated = 0
        error = None
        try:
            for j, i in enumerate(mine):
                sample, was_truncated = self.builder.build(self.rows.row(i), f"{self.name} row {i}")
                lengths[j] = len(sample.input_ids) if sample else DROPPED_NO_TARGET
                truncated += was_truncated
        except InvalidData as err:
            error = str(err)
        gathered = dist_utils.all_gather_objects((lengths, truncated, error))
        errors = [e for _, _, e in gathered if e]
        if errors:
            raise InvalidData(errors[0])
        full = np.concatenate([part for part, _, _ in gathered])
        assert len(full) == self.rows.num_rows
        stats = ScanStats(
            rows=self.rows.num_rows,
            usable=int((full > 0).sum()),
            truncated=sum(t for _, t, _ in gathered),
            dropped_no_target=int((full == DROPPED_NO_TARGET).sum()),
        )
        return full, stats

    def sample(self, index: int) -> Sample:
        sample, _ = self.builder.build(self.rows.row(int(index)), f"{self.name} row {index}")
        assert sample is not None, "rows without targets were excluded by the scan"
        return sample

    def fingerprint(self) -> str:
        return self.rows.fingerprint()

    def close(self) -> None:
        self.rows.close()

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The usable row indices of one epoch, in training order.

        Shuffling is two-level (row groups, then rows within a group) so that a rank reads
        one row group after another instead of jumping across the whole file.
        """
        if not shuffle:
            return self.valid
        rng = np.random.default_rng([seed, epoch])
        group_ids = np.searchsorted(self.rows.group_start, self.valid, side="right") - 1
        order = []
        for g in rng.permutation(len(self.rows.groups)):
            members = self.valid[group_ids == g]
            order.append(rng.permutation(members))
        return np.concatenate(order) if order else self.valid


# --------------------------------------------------------------------------- batching


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    sample_ids: list[int]
    n_tokens: int  # real (non-pad) tokens
    n_targets: int
    seq_lengths: list[int]


def collate(samples: list[Sample], ids: list[int], packing: bool, pad_id: int) -> MicroBatch:
    lengths = [len(s.input_ids) for s in samples]
    if packing:
        # One row, positions restarting per sequence and no attention mask: transformers
        # then builds a block-diagonal causal mask (sdpa) or uses varlen flash-attention.
        input_ids = torch.tensor([[t for s in samples for t in s.input_ids]])
        targets = torch.tensor([[t for s in samples for t in s.targets]])
        position_ids = torch.tensor([[p for n in lengths for p in range(n)]])
        mask = None
    else:
        width = max(lengths)
        input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
        targets = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.input_ids)
            input_ids[i, :n] = torch.tensor(s.input_ids)
            targets[i, :n] = torch.tensor(s.targets)
            mask[i, :n] = 1
        position_ids = torch.arange(width).unsqueeze(0).expand(len(samples), -1).contiguous()
    return MicroBatch(
        input_ids=input_ids,
        targets=targets,
        position_ids=position_ids,
        attention_mask=mask,
        sample_ids=list(ids),
        n_tokens=sum(lengths),
        n_targets=sum(s.n_targets for s in samples),
        seq_lengths=lengths,
    )


class GlobalBatches:
    """The global-cursor schedule: which samples each rank trains on at each step."""

    def __init__(self, dataset: SFTDataset, cfg: DataConfig, seed: int, rank: int, world: int, pad_id: int):
        if cfg.train_batch_size % world:
            raise InvalidData(
                f"data.train_batch_size ({cfg.train_batch_size}) must be divisible by the number of "
                f"processes ({world})"
            )
        self.per_rank = cfg.train_batch_size // world
        if self.per_rank % cfg.micro_batch_size_per_gpu:
            raise InvalidData(
                f"data.micro_batch_size_per_gpu ({cfg.micro_batch_size_per_gpu}) must divide the per-rank batch "
                f"({self.per_rank} = data.train_batch_size {cfg.train_batch_size} / {world} processes)"
            )
        self.dataset, self.cfg, self.seed, self.rank, self.pad_id = dataset, cfg, seed, rank, pad_id
        self.global_batch = cfg.train_batch_size
        self.steps_per_epoch = len(dataset.valid) // self.global_batch
        if self.steps_per_epoch == 0:
            raise InvalidData(
                f"train data has {len(dataset.valid)} usable rows, fewer than one global batch "
                f"(data.train_batch_size={self.global_batch})"
            )
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self.dataset.epoch_order(self.seed, epoch, self.cfg.shuffle)
            self._order_epoch = epoch
        return self._order

    def step_batches(self, epoch: int, cursor: int) -> list[MicroBatch]:
        """The micro-batches of this rank for the global batch starting at ``cursor``."""
        ids = self.order(epoch)[cursor : cursor + self.global_batch]
        slices = [ids[r * self.per_rank : (r + 1) * self.per_rank] for r in range(self.global_batch // self.per_rank)]
        mine = slices[self.rank]
        if self.cfg.max_tokens_per_micro_batch is None:
            m = self.cfg.micro_batch_size_per_gpu
            groups = [mine[k : k + m] for k in range(0, len(mine), m)]
        else:
            # Every rank must run the same number of forwards (FSDP gathers weights in each),
            # and each can count the others' from the shared lengths table: no communication.
            budget = self.cfg.max_tokens_per_micro_batch
            lengths = self.dataset.lengths
            count = max(len(token_groups(lengths[s], budget)) for s in slices)
            groups = [mine[g] for g in split_to(token_groups(lengths[mine], budget), count)]
        out = []
        for group in groups:
            chunk = [int(i) for i in group]
            out.append(collate([self.dataset.sample(i) for i in chunk], chunk, self.cfg.packing, self.pad_id))
        return out


def token_groups(lengths: np.ndarray, budget: int) -> list[slice]:
    """Consecutive runs of samples whose lengths sum to at most ``budget`` (at least one sample each)."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(int(x) for x in lengths):
        if i > start and used + n > budget:
            groups.append(slice(start, i))
            start, used = i, 0
        used += n
    if len(lengths):
        groups.append(slice(start, len(lengths)))
    return groups


def split_to(groups: list[slice], count: int) -> list[slice]:
    """Split the groups with the most samples in halves until there are ``count`` of them."""
    groups = list(groups)
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: groups[j].stop - groups[j].start)
        g = groups[k]
        if g.stop - g.start < 2:
            raise AssertionError("cannot split a rank's batch into more micro-batches than samples")
        mid = g.start + (g.stop - g.start) // 2
        groups[k : k + 1] = [slice(g.start, mid), slice(mid, g.stop)]
    return groups


def eval_batches(dataset: SFTDataset, micro: int, rank: int, world: int, packing: bool, pad_id: int) -> Iterator[MicroBatch]:
    """This rank's share of the validation set in file order (every usable row once)."""
    mine = dataset.valid[rank::world]
    for k in range(0, len(mine), micro):
        chunk = [int(i) for i in mine[k : k + micro]]
        yield collate([dataset.sample(i) for i in chunk], chunk, packing, pad_id)
