"""Experiment tracking: the run's curves and parameters, where practitioners compare runs.

One small interface (``Backend``: start, log, commit, finish) and three backends, each in its
own module: TensorBoard event files beside the run's outputs (track_tensorboard.py), an
MLflow run (track_mlflow.py), a W&B run (track_wandb.py). Only rank 0 tracks.

Two promises hold for every backend, and both live here rather than in each backend:

- **A resumed job continues its run, and no step is logged twice.** Every backend finds its
  run again by the job's identity (``RunInfo.identity``, derived from ``trainer.output_dir``,
  which holds the job's uid and so is the same for all attempts of a job and for no other
  job), and ``start`` answers the last step it already holds for each metric. A resume from
  checkpoint step N trains steps N+1.. again, some of which an earlier attempt may have
  logged; ``Tracker.log`` drops a metric at a step not above what its backend already holds.
  Exact resume makes the dropped values equal to the kept ones, so nothing is lost.
- **A backend that is down never stops training.** Its failures are logged (the first with a
  warning, then quietly), counted (``tracking_errors``, sftjob_trainer_tracking_errors_total), and the
  rows it missed are kept (at most ``MAX_PENDING``) and retried at a later log, no sooner than
  a backoff that doubles up to ``MAX_BACKOFF_S``, so a dead server costs training nothing
  but a bounded buffer.

Every backend call (network I/O to MLflow or W&B, event-file writes and uploads) runs on one
worker thread, in call order: the training loop only enqueues, so a slow or hanging server
never holds a step. ``finish`` waits for the queue (``FINISH_WAIT_S``), ``close`` only briefly
(``CLOSE_WAIT_S``: a stopping attempt spends its SIGTERM budget on the checkpoint).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sftjob_contract import env as E
from sftjob_contract.config import SFTConfig

from .track_base import ALL, OUTPUT_URI, RunInfo  # noqa: F401 - OUTPUT_URI: part of this API

log = logging.getLogger(__name__)

MAX_PENDING = 10_000     # rows kept for a backend that is down; the oldest go first
MAX_BACKOFF_S = 60.0     # the longest wait between two tries of a failing backend
# A backend that cannot even open its run this many times in a row (about 2 minutes of backoff)
# is given up for this attempt: each try may cost a connect timeout (W&B's init: INIT_TIMEOUT_S).
MAX_START_TRIES = 8
FINISH_WAIT_S = 120.0    # the end of training waits this long for the queued calls
CLOSE_WAIT_S = 5.0       # a stopping attempt waits only this long
# The trainer's row keys (metrics.jsonl) and the names the trackers show them under.
METRIC_NAMES = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu", "val_loss": "val/loss", "best_val_loss": "val/best_loss",
}


class Backend(Protocol):
    name: str

    def start(self, run: RunInfo, params: dict[str, str]) -> dict[str, int]:
        """Open (or find again) the job's run, record ``params`` if it has not; returns the
        last step it already holds for each metric name (or for all of them, under ``ALL``)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def commit(self) -> None:
        """Make what was logged durable beside the checkpoint that just committed."""

    def finish(self, status: str, output_uri: str | None) -> None:
        """``status``: FINISHED (training done, model exported) or KILLED (this attempt ends
        early; a later attempt continues the run)."""


def run_info(cfg: SFTConfig) -> RunInfo:
    out = cfg.trainer.output_dir.rstrip("/")
    name = os.environ.get(E.JOB_NAME) or "/".join(out.split("/")[-3:-1]) or out
    return RunInfo(identity=hashlib.sha256(out.encode()).hexdigest()[:32], output_dir=out, name=name)


def params(cfg: SFTConfig) -> dict[str, str]:
    """The resolved config, flattened to dotted keys, minus anything that names a credential
    (the config holds Secret names only, never a credential, but these are not parameters)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if not k.endswith("_secret"):
                    walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = str(value)

    walk("", cfg.model_dump(mode="json"))
    return flat


def rows_of(step_row: dict[str, Any]) -> dict[str, float]:
    """The tracked metrics of one metrics.jsonl row, under their tracking names; non-numbers dropped."""
    out = {}
    for key, name in METRIC_NAMES.items():
        v = step_row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v)
    return out


@dataclass
class _Guarded:
    """One backend behind the two promises of the module docstring."""

    backend: Backend
    started: bool = False
    last: dict[str, int] = field(default_factory=dict)     # per metric: the last step the backend holds
    pending: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    failures: int = 0
    retry_at: float = 0.0


class Tracker:
    """What train.py talks to: fans each call out to the configured backends, on one worker
    thread (``commit`` comes from the checkpoint commit thread, ``log`` from the loop)."""

    def __init__(self, backends: list[Backend], run: RunInfo | None = None, params: dict[str, str] | None = None,
                 count_error=None):
        self._backends = [_Guarded(b) for b in backends]
        self._run, self._params = run, params or {}
        self._count_error = count_error or (lambda: None)
        self._finished = False
        self._calls: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        if self._backends:
            threading.Thread(target=self._work, name="sftjob-tracking", daemon=True).start()
        for g in list(self._backends):
            self._submit(lambda g=g: self._try(g, lambda: self._start(g)))

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call()
            except Exception:  # _try catches the backends'; this is a last guard
                log.exception("tracking: internal error")
            finally:
                self._calls.task_done()

    def _submit(self, call) -> None:
        """Queue a call for the worker; a full queue (the worker stuck that long) drops it, counted."""
        try:
            self._calls.put_nowait(call)
        except queue.Full:
            self._count_error()

    def wait(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the queued calls (Queue.join has no timeout)."""
        done = threading.Event()

        def join() -> None:
            self._calls.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        if not done.wait(timeout_s):
            log.warning("tracking: calls still queued after %.0fs; the attempt ends without them", timeout_s)

    @property
    def backends(self) -> list[str]:
        return [g.backend.name for g in self._backends]

    def log(self, step: int, row: dict[str, Any]) -> None:
        metrics = rows_of(row)
        if metrics and self._backends:
            self._submit(lambda: self._log(step, metrics))

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for g in list(self._backends):
            g.pending.append((step, metrics))
            del g.pending[:-MAX_PENDING]
            if time.monotonic() >= g.retry_at:
                self._try(g, lambda g=g: self._flush(g))

    def commit(self) -> None:
        """Called on the checkpoint commit thread: queued behind the rows logged before it."""
        if not self._backends:
            return

        def commit_all() -> None:
            for g in list(self._backends):
                self._try(g, lambda g=g: self._flush_then(g, g.backend.commit))

        self._submit(commit_all)

    def finish(self, output_uri: str) -> str:
        """Training is done and the model exported at ``output_uri``: close every run as
        FINISHED (one last try for a backend that was down). Returns ``output_uri``."""
        self._close("FINISHED", output_uri)
        return output_uri

    def close(self) -> None:
        """The attempt ends without finishing (preemption, failure): the run stays open for the next."""
        self._close("KILLED", None)

    def _close(self, status: str, output_uri: str | None) -> None:
        if self._finished or not self._backends:
            return
        self._finished = True

        def close_all() -> None:
            for g in list(self._backends):
                if status == "FINISHED":   # one last try; a stopping attempt (SIGTERM's budget) waits for none
                    g.retry_at = 0.0
                self._try(g, lambda g=g: self._flush_then(g, lambda: g.backend.finish(status, output_uri)))

        self._calls.put(close_all)   # blocking: the last call is never dropped
        self.wait(FINISH_WAIT_S if status == "FINISHED" else CLOSE_WAIT_S)

    def _start(self, g: _Guarded) -> None:
        assert self._run is not None
        g.last = dict(g.backend.start(self._run, self._params))
        g.started = True
        if g.last:
            log.info("tracking: %s continues its run (last step logged: %d)", g.backend.name, max(g.last.values()))

    def _flush(self, g: _Guarded) -> None:
        if not g.started:
            self._start(g)
        while g.pending:
            step, metrics = g.pending[0]
            held = g.last.get(ALL, 0)
            fresh = {k: v for k, v in metrics.items() if step > max(held, g.last.get(k, 0)) and math.isfinite(v)}
            if fresh:
                g.backend.log(step, fresh)
                g.last.update(dict.fromkeys(fresh, step))
            g.pending.pop(0)

    def _flush_then(self, g: _Guarded, then: Callable[[], None]) -> None:
        """Flush ``g``'s pending rows, then (unless that failed) ``then()``: a commit or finish
        applies to every row logged before it."""
        self._flush(g)
        then()

    def _try(self, g: _Guarded, action) -> None:
        """Run ``action``; a failure is counted, warned about once, and retried after a backoff."""
        if (g.retry_at and time.monotonic() < g.retry_at) or g not in self._backends:
            return
        try:
            action()
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            g.failures += 1
            self._count_error()
            g.retry_at = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** min(g.failures - 1, 6))
            say = log.warning if g.failures == 1 else log.debug
            say("tracking: %s failed (%s: %s); training goes on, %d rows kept to retry", g.backend.name,
                type(err).__name__, err, len(g.pending))
            if not g.started and g.failures >= MAX_START_TRIES:
                log.warning("tracking: %s could not start in %d tries; this attempt goes on without it",
                            g.backend.name, g.failures)
                self._backends.remove(g)
            return
        if g.failures:
            log.info("tracking: %s works again after %d failures", g.backend.name, g.failures)
        g.failures, g.retry_at = 0, 0.0


def open_tracker(cfg: SFTConfig, is_main: bool, store, metrics=None) -> Tracker:
    """The run's Tracker: the configured backends on rank 0, none elsewhere or when off."""
    t = cfg.tracking
    if not is_main or not t.enabled:
        return Tracker([])
    backends: list[Backend] = []
    if t.tensorboard:
        from .track_tensorboard import TensorBoard
        backends.append(TensorBoard(store))
    if t.mlflow is not None:
        from .track_mlflow import Mlflow
        backends.append(Mlflow(t.mlflow))
    if t.wandb is not None:
        from .track_wandb import Wandb
        backends.append(Wandb(t.wandb))
    count = (lambda: metrics.count(tracking_errors=1)) if metrics is not None else None
    tracker = Tracker(backends, run_info(cfg), params(cfg), count)
    log.info("tracking to %s", ", ".join(tracker.backends))
    return tracker
