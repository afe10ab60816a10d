"""Training metrics: one JSON line per step/validation, mirrored on a Prometheus endpoint.

Only rank 0 writes; every value it writes is already reduced over all ranks. The metric
names are the contract's (sftjob_contract.metrics): the operator scrapes some of them.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from http.server import ThreadingHTTPServer
from typing import Any

from sftjob_contract import metrics as M

from .control import Requests, serve

log = logging.getLogger(__name__)

_GAUGES = {
    "step": (M.STEP, "Optimizer steps completed"),
    "total_steps": (M.TOTAL_STEPS, "Optimizer steps this run will take"),
    "epoch": (M.EPOCH, "Current epoch (0-based)"),
    "loss": (M.LOSS, "Training loss of the last step (mean over target tokens)"),
    "val_loss": (M.VAL_LOSS, "Loss on the validation set at the last validation"),
    "best_val_loss": (M.BEST_VAL_LOSS, "Lowest validation loss so far"),
    "best_val_step": (M.BEST_VAL_STEP, "Step of the validation with the lowest loss"),
    "val_without_improvement": (M.VALIDATIONS_WITHOUT_IMPROVEMENT,
                                "Validations in a row without an improvement over the best (early stopping)"),
    "early_stopped": (M.EARLY_STOPPED, "1 once early stopping ended training"),
    "holding": (M.HOLDING, "1 while training waits after a checkpoint the operator asked for (a planned stop)"),
    "lr": (M.LEARNING_RATE, "Learning rate of the last step"),
    "grad_norm": (M.GRAD_NORM, "Global gradient norm before clipping"),
    "tokens_per_s": (M.TOKENS_PER_SECOND, "Real (non-pad) tokens per second, all ranks"),
    "mfu": (M.MFU, "Model FLOPs utilisation of the last step (0..1)"),
    "last_checkpoint_step": (M.LAST_CHECKPOINT_STEP, "Step of the newest committed checkpoint"),
    "checkpoint_save_seconds": (M.CHECKPOINT_SAVE_SECONDS, "Seconds training was blocked by the last checkpoint"),
    "last_checkpoint_time": (M.LAST_CHECKPOINT_TIMESTAMP_SECONDS,
                             "Unix time of the newest checkpoint (checkpoint age = time() - this)"),
    # The preflight report, one series per training source (label M.SOURCE_LABEL): `sources()`.
    "source_rows": (M.SOURCE_ROWS, "Rows read from the training source"),
    "source_usable": (M.SOURCE_USABLE_ROWS, "Rows of the training source that train"),
    "source_dropped": (M.SOURCE_DROPPED_ROWS, "Rows of the training source dropped: no trainable token"),
    "source_truncated": (M.SOURCE_TRUNCATED_ROWS, "Rows of the training source truncated to data.max_length"),
    "source_tokens": (M.SOURCE_TOKENS, "Tokens of the training source's usable rows, after truncation"),
    "source_samples_per_epoch": (M.SOURCE_SAMPLES_PER_EPOCH, "Samples the training source contributes to each epoch"),
}
# Per-source gauges: gauge key -> the mixing.SourceReport field it shows.
_PER_SOURCE = {k: k.removeprefix("source_") for k in _GAUGES if k.startswith("source_")}
# Gauges that have no value until the first step measures them: NaN, never a fake 0.
_UNSET_UNTIL_MEASURED = ("loss", "val_loss", "best_val_loss", "best_val_step", "lr", "grad_norm", "tokens_per_s",
                         "mfu", "checkpoint_save_seconds", "last_checkpoint_time")
_COUNTERS = {
    "tokens": (M.TOKENS, "Real (non-pad) tokens processed"),
    "skipped": (M.SKIPPED_STEPS, "Steps skipped for a non-finite loss or gradient norm"),
    "failed_commits": (M.FAILED_CHECKPOINT_COMMITS, "Checkpoint commits that failed"),
    "tracking_errors": (M.TRACKING_ERRORS, "Failed calls to a tracking backend (training went on)"),
}
# Measured values that may be non-finite: a NaN loss is news, not a value to hide.
_SHOWN_NON_FINITE = ("loss", "grad_norm", "val_loss")


class Metrics:
    def __init__(self, path: Path | None, port: int = 0):
        self.path = path
        self._fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", buffering=1)
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._server: ThreadingHTTPServer | None = None
        self.requests = Requests()   # the operator's "checkpoint now" (control.py), on the same port
        if port:
            self._start_server(port)

    def _start_server(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        registry = CollectorRegistry()
        self._gauges = {k: Gauge(n, h, [M.SOURCE_LABEL] if k in _PER_SOURCE else (), registry=registry)
                        for k, (n, h) in _GAUGES.items()}
        self._counters = {k: Counter(n, h, registry=registry) for k, (n, h) in _COUNTERS.items()}
        for k in _UNSET_UNTIL_MEASURED:
            self._gauges[k].set(float("nan"))
        self._server = serve(port, registry, self.requests)
        log.info("metrics on :%d/metrics, checkpoint requests on :%d/checkpoint", port, port)

    def gauge(self, **values: float) -> None:
        for k, v in values.items():
            if (k in self._gauges and k not in _PER_SOURCE and v is not None
                    and (math.isfinite(v) or k in _SHOWN_NON_FINITE)):
                self._gauges[k].set(v)

    def sources(self, reports: list[Any]) -> None:
        """The preflight report of each training source (mixing.SourceReport) as labelled gauges."""
        for report in reports:
            for k, field in _PER_SOURCE.items():
                if k in self._gauges:
                    self._gauges[k].labels(report.source).set(getattr(report, field))

    def count(self, **values: float) -> None:
        for k, v in values.items():
            if k in self._counters and v:
                self._counters[k].inc(v)

    def record(self, **row: Any) -> None:
        """Append one JSON line (stamped with the wall clock) and update the matching gauges."""
        if self._fh is not None:
            # The wall clock lets a reader time a window of steps including everything between
            # them (batch building, logging), which per-step durations leave out.
            self._fh.write(json.dumps({**row, "time": round(time.time(), 3)}) + "\n")
        self.gauge(**{k: v for k, v in row.items() if isinstance(v, (int, float))})

    def close(self, linger_s: float = 0.0) -> None:
        """Stop; ``linger_s`` keeps the endpoint up so a scraper sees the final values."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._server is not None:
            if linger_s:
                time.sleep(linger_s)
            self._server.shutdown()
            self._server = None


def step_flops(n_matmul: int, n_layers: int, d_attn: int, seq_lengths: list[int]) -> float:
    """Useful training FLOPs of a step: 6·N per real token plus causal attention.

    Matches the bench README: 6·N_matmul·T + 6·n_layers·d_attn·Σ s_i² (forward 2 + backward
    4 per parameter and token; QKᵀ and A·V halved by causality, ×3 for backward).
    """
    tokens = sum(seq_lengths)
    return 6.0 * n_matmul * tokens + 6.0 * n_layers * d_attn * sum(s * s for s in seq_lengths)
