"""Weighted mixing of several training sources (data.sources) into one resumable order.

The rule, which docs/trainer.md ("Mixing data sources") states for users:
- An epoch has N = the sum of all sources' usable rows samples. Source s (weight share
  p_s = w_s / sum w) contributes q_s of them: p_s * N rounded by largest remainder (the
  rounding remainders go to the largest fractional parts, ties to the lower index), so
  sum q_s = N exactly.
- Each source is an endless stream of passes over its usable rows, pass k being a seeded
  permutation keyed by (trainer.seed, source index, k) (in file order when data.shuffle is
  off). Epoch e takes stream positions [e*q_s, (e+1)*q_s): a source larger than its share
  goes on where the previous epoch stopped (every row is seen before any is repeated), a
  smaller one is upsampled by whole fresh passes. So within an epoch each
  (source, row, pass) appears at most once, and over the whole stream exactly once.
- The sources' slots are interleaved by a seeded permutation of q_s labels per source,
  keyed by (trainer.seed, epoch); without shuffling, by an even spread (stride order).

Everything is a pure function of (seed, epoch) and the scanned row counts, never of the
world size: the global cursor of `batching.GlobalBatches` resumes it exactly, mid-epoch and
on another number of ranks. Global sample ids are a source's offset plus its row index.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass

import numpy as np

from sftjob_contract.config import DataConfig

from .data import Sample, SampleBuilder, ScanCache, SFTDataset

log = logging.getLogger(__name__)

PASS_STREAM = 0x6D6978       # keys the passes of a source: rng([seed, PASS_STREAM, source, pass])
INTERLEAVE_STREAM = 0x696C76  # keys an epoch's interleaving: rng([seed, INTERLEAVE_STREAM, epoch])


def quotas(usable: list[int], weights: list[float]) -> list[int]:
    """Samples per epoch of each source: its weight share of all usable rows, rounded by
    largest remainder so that they sum to exactly that total."""
    total = sum(usable)
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    exact = shares * total
    base = np.floor(exact).astype(np.int64)
    left = total - int(base.sum())
    # Largest fractional part first; a stable sort keeps ties in source order.
    for s in np.argsort(-(exact - base), kind="stable")[:left]:
        base[s] += 1
    return [int(q) for q in base]


def stream_window(n: int, quota: int, epoch: int) -> list[tuple[int, int, int]]:
    """(pass, start, stop) slices of a source's pass stream that epoch ``epoch`` takes."""
    lo, hi = epoch * quota, (epoch + 1) * quota
    out = []
    for k in range(lo // n, -(-hi // n)):
        start, stop = max(lo - k * n, 0), min(hi - k * n, n)
        if stop > start:
            out.append((k, start, stop))
    return out


def interleave(counts: list[int], seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The source label of every slot of an epoch: ``counts[s]`` slots for source s."""
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if shuffle:
        return np.random.default_rng([seed, INTERLEAVE_STREAM, epoch]).permutation(labels)
    # Stride order: the k-th sample of source s sits at (k + 1/2) / q_s of the epoch.
    keys = np.concatenate([(np.arange(q) + 0.5) / q for q in counts if q] or [np.empty(0)])
    return labels[np.argsort(keys, kind="stable")]


@dataclass(frozen=True)
class SourceReport:
    """The preflight report of one source: what was read, kept and how it is mixed."""

    source: str
    format: str
    files: int
    rows: int
    usable: int
    dropped: int      # rows without a trainable token (empty response, or truncated away)
    truncated: int
    tokens: int       # tokens of the usable rows, after truncation
    weight: float
    share: float      # the normalized weight
    samples_per_epoch: int

    def describe(self) -> str:
        passes = self.samples_per_epoch / max(self.usable, 1)
        return (f"train source {self.source!r} ({self.format}, {self.files} file(s)): {self.rows} rows read, "
                f"{self.usable} usable, {self.dropped} dropped (no trainable token), {self.truncated} truncated, "
                f"{self.tokens} tokens; weight {self.weight:g} = {100 * self.share:.1f}% -> "
                f"{self.samples_per_epoch} samples per epoch ({passes:.2f} passes)")


class MixedDataset:
    """Several scanned sources behind the dataset interface `GlobalBatches` uses."""

    def __init__(self, parts: list[SFTDataset], names: list[str], weights: list[float]):
        self.parts, self.names, self.weights = parts, names, weights
        self.offsets = np.concatenate([[0], np.cumsum([p.rows.num_rows for p in parts])]).astype(np.int64)
        self.lengths = np.concatenate([p.lengths for p in parts])
        self.valid = np.concatenate([p.valid + off for p, off in zip(parts, self.offsets)])
        self.quotas = quotas([len(p.valid) for p in parts], weights)
        self.epoch_size = sum(self.quotas)
        self._plan_key: tuple | None = None
        self._plan: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def epoch_plan(self, seed: int, epoch: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, row, pass) of every sample of epoch ``epoch``, in training order."""
        key = (seed, epoch, shuffle)
        if key == self._plan_key and self._plan is not None:
            return self._plan
        labels = interleave(self.quotas, seed, epoch, shuffle)
        rows = np.empty(len(labels), dtype=np.int64)
        passes = np.empty(len(labels), dtype=np.int64)
        for s, (part, q) in enumerate(zip(self.parts, self.quotas)):
            taken, repeat = [], []
            for k, start, stop in stream_window(len(part.valid), q, epoch):
                taken.append(part.epoch_order(seed, k, shuffle, stream=(PASS_STREAM, s))[start:stop])
                repeat.append(np.full(stop - start, k, dtype=np.int64))
            if q:
                rows[labels == s] = np.concatenate(taken)
                passes[labels == s] = np.concatenate(repeat)
        self._plan_key, self._plan = key, (labels, rows, passes)
        return self._plan

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """Global sample ids (source offset + row) of epoch ``epoch``, in training order."""
        labels, rows, _ = self.epoch_plan(seed, epoch, shuffle)
        return self.offsets[labels] + rows

    def sample(self, index: int) -> Sample:
        s = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return self.parts[s].sample(int(index) - int(self.offsets[s]))

    def fingerprint(self) -> str:
        """The sources' data, names and weights: a resume with other weights would change the order."""
        desc = [(n, w, p.format, p.fingerprint()) for n, w, p in zip(self.names, self.weights, self.parts)]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def reports(self) -> list[SourceReport]:
        total = float(sum(self.weights))
        return [_report(n, p, w, w / total, q) for n, p, w, q in zip(self.names, self.parts, self.weights, self.quotas)]

    def close(self) -> None:
        for p in self.parts:
            p.close()


def _report(name: str, ds: SFTDataset, weight: float, share: float, per_epoch: int) -> SourceReport:
    st = ds.stats
    return SourceReport(source=name, format=ds.format, files=len(ds.rows.files), rows=st.rows, usable=st.usable,
                        dropped=st.dropped_no_target, truncated=st.truncated, tokens=ds.tokens, weight=weight,
                        share=share, samples_per_epoch=per_epoch)


def train_dataset(tokenizer, cfg: DataConfig, builder: SampleBuilder, rank: int = 0, world: int = 1,
                  cache: ScanCache | None = None) -> SFTDataset | MixedDataset:
    """The training data: data.train_files as it always was, or data.sources mixed."""
    if cfg.sources is None:
        return SFTDataset(cfg.train_files or [], builder, "train", rank, world, cache)
    parts, names = [], cfg.source_names()
    for i, (source, name) in enumerate(zip(cfg.sources, names)):
        prompt, response, messages = source.columns(cfg)
        own = cfg.model_copy(update={"prompt_key": prompt, "response_key": response, "messages_key": messages})
        where = f"spec.data.sources[{i}]"
        parts.append(SFTDataset(source.files, SampleBuilder(tokenizer, own), f"source {name}", rank, world, cache,
                                field=f"{where}.files", fmt=source.format, format_field=f"{where}.format"))
    mixed = MixedDataset(parts, names, [s.weight for s in cfg.sources])
    for report in mixed.reports():
        log.info(report.describe())
        if report.samples_per_epoch == 0:
            log.warning("train source %r gets no sample per epoch: its weight is too small for the data", report.source)
    return mixed


def reports(ds: SFTDataset | MixedDataset) -> list[SourceReport]:
    """The preflight report of each training source (data.train_files: one source 'train')."""
    if isinstance(ds, MixedDataset):
        return ds.reports()
    return [_report("train", ds, 1.0, 1.0, ds.epoch_size)]


def publish_report(metrics, ds: SFTDataset | MixedDataset, fresh: bool) -> None:
    """Per-source gauges for every run; for mixed data (on a start from step 0) also one
    metrics.jsonl line: {"preflight": [report per source], "epoch_samples": N}. A train_files
    run's metrics.jsonl stays exactly as it was."""
    found = reports(ds)
    metrics.sources(found)
    if fresh and isinstance(ds, MixedDataset):
        metrics.record(preflight=[asdict(r) for r in found], epoch_samples=ds.epoch_size)
