"""SFT data: parquet rows (`parquet.py`) → token ids with loss targets → a resumable sample
order, which `batching.py` cuts into batches.

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

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sftjob_contract.config import DataConfig

from . import dist as dist_utils
from .errors import InvalidData, TrainerError
from .jsonl import open_rows

log = logging.getLogger(__name__)

IGNORE = -100

# Lengths table codes for rows that never become samples.
DROPPED_NO_TARGET = -1

# The spec field that lists each dataset's files, for messages.
FILES_FIELD = {"train": "spec.data.trainFiles", "val": "spec.data.valFiles"}


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    targets: list[int]  # already shifted: targets[t] is the label for predicting input_ids[t+1]

    @property
    def n_targets(self) -> int:
        return sum(1 for t in self.targets if t != IGNORE)


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
            return self._encode_chat([{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": response}], where)
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
        pct = lambda n: 100.0 * n / max(self.rows, 1)  # noqa: E731 - a one-line helper for the log line
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
                 cache: ScanCache | None = None, *, field: str | None = None, fmt: str | None = "parquet",
                 format_field: str | None = None):
        """``field``: the spec field of ``patterns``, for messages; ``fmt``: parquet, jsonl, or
        None to tell from the file names (``format_field`` then names the setting)."""
        self.name = name
        self._rank, self._world = rank, world
        self.builder = builder
        field = field or FILES_FIELD.get(name, name)
        self.format, self.rows = open_rows(patterns, builder.columns, field, fmt, format_field)
        files = self.rows.files
        if self.rows.num_rows == 0:
            raise InvalidData(f"{field}: {name} data ({', '.join(files)}) has no rows")
        self.lengths, self.stats = self._cached_scan(cache)
        self.valid = np.flatnonzero(self.lengths > 0)
        if len(self.valid) == 0:
            raise InvalidData(self._why_nothing_trains(field))
        log.info(self.stats.describe(name))

    def _why_nothing_trains(self, field: str) -> str:
        s, cfg = self.stats, self.builder.cfg
        head = f"{self.name} data has no trainable tokens: all {s.rows} rows were dropped"
        if not s.truncated:
            return f"{head}; every response is empty ({field})"
        # A row truncated and dropped lost its response to truncation: a longer limit keeps it.
        return (f"{head}; spec.data.maxLength ({cfg.max_length}) is too small for the data: truncation "
                f"('{cfg.truncation}') removed every response token of {s.truncated} rows"
                + (f" (the other {s.rows - s.truncated} have empty responses)" if s.truncated < s.rows else "")
                + ". Raise spec.data.maxLength" + (", or truncate 'left' to keep the ends of the conversations"
                                                   if cfg.truncation == "right" else ""))

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
                     "builder": self.builder.identity(),
                     **({"format": self.format} if self.format != "parquet" else {})}
            digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
            key = f"scan-{self.name.replace(' ', '-')}-{digest}.npz"
            found = _decode_scan(cache.get(key), self.rows.num_rows)
            if found is not None:
                log.info("%s data: reusing the token-length scan %s", self.name, key)
        found = dist_utils.broadcast_object(found)
        if found is not None:
            return found
        lengths, stats = self._scan()
        if self._rank == 0 and key is not None:  # rank 0 always made the key above
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
        except TrainerError as err:  # a bad row, or storage that failed: every rank must hear of it
            error = (type(err), str(err))
        gathered = dist_utils.all_gather_objects((lengths, truncated, error))
        errors = [e for _, _, e in gathered if e]
        if errors:
            kind, message = errors[0]
            raise kind(message)
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

    @property
    def epoch_size(self) -> int:
        """Samples in one epoch: every usable row once."""
        return len(self.valid)

    @property
    def tokens(self) -> int:
        """Tokens of all usable rows (after truncation), for the preflight report."""
        return int(self.lengths[self.valid].sum())

    def close(self) -> None:
        self.rows.close()

    def epoch_order(self, seed: int, epoch: int, shuffle: bool, stream: tuple[int, ...] = ()) -> np.ndarray:
        """The usable row indices of one epoch, in training order.

        Shuffling is two-level (row groups, then rows within a group) so that a rank reads
        one row group after another instead of jumping across the whole file. ``stream``
        keys an independent sequence of permutations (a mixed source's passes, mixing.py);
        the default is the single-source order.
        """
        if not shuffle:
            return self.valid
        rng = np.random.default_rng([seed, *stream, epoch])
        group_ids = np.searchsorted(self.rows.group_start, self.valid, side="right") - 1
        order = []
        for g in rng.permutation(len(self.rows.groups)):
            members = self.valid[group_ids == g]
            order.append(rng.permutation(members))
        return np.concatenate(order) if order else self.valid
