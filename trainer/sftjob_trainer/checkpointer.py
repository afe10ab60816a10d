"""The Checkpointer: save, commit, resume and prune, for any ``storage.Store``.

A save blocks training only while each rank copies its shards to host memory (buffers
kept from one save to the next: host memory for one more copy of the shards). A final save
(end of training, the stop checkpoint after SIGTERM) copies nothing: no step follows it, so
its shards are written from the live tensors, and the buffers of earlier saves are freed
first (the end of a run, which also gathers the export, is not the moment to hold a second
copy of the parameters and optimizer state). The rest
runs behind it: DCP writes the copies to local disk (its own gloo process group, so its
collectives never meet the training step's), then each rank publishes its files (in
place for a local directory, an upload for s3://) and reports them, and rank 0 commits
(``checkpoint.commit``: manifest, marker, ``latest``) and only then prunes. The commit
runs either before ``save`` returns (``Inline``) or in one background thread, in save
order (``Background``, what the trainer uses). A new save first waits for the previous
one's shards to be written; the stop checkpoint after SIGTERM and the end of training
wait for the commit, bounded by the stop deadline. No collective runs in the commit
thread.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from . import checkpoint as ckpt
from . import dist as dist_utils
from sftjob_contract.layout import CHECKPOINTS, checkpoint_dir
from .storage import Store, UploadError, fresh_dir

log = logging.getLogger(__name__)


class CommitStrategy(Protocol):
    """How the publish-and-commit part of a save runs."""

    def submit(self, fn: Callable[[], int]) -> Future: ...

    def abandon(self) -> None:
        """Give up on what is running (the stop deadline passed); later saves still run."""


class Inline:
    """Commit before ``save`` returns: simplest to reason about, and what tests use."""

    def submit(self, fn: Callable[[], int]) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn())
        except Exception as err:  # noqa: BLE001 - handed to whoever waits, as a thread would
            done.set_exception(err)
        return done

    def abandon(self) -> None:
        pass


class Background:
    """Commit in one worker thread, in save order, while training goes on."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")

    def submit(self, fn: Callable[[], int]) -> Future:
        return self._pool.submit(fn)

    def abandon(self) -> None:
        # The running commit cannot be interrupted; its deadline stops it writing the marker.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")


class Checkpointer:
    def __init__(self, store: Store, rank: int, world: int, keep: int, deadline_s: float = 600.0,
                 strategy: CommitStrategy | None = None):
        self.store, self.rank, self.world, self.keep, self.deadline_s = store, rank, world, keep, deadline_s
        self.strategy = strategy if strategy is not None else Background()
        self.where = f"{store.uri}/{CHECKPOINTS}"
        # Reports left by an earlier attempt at the same step must not count for this one.
        self.attempt = dist_utils.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._stager = ckpt.host_stager()
        self._written: Future | None = None  # the shards of the newest save, on local disk
        self._pending: Future | None = None  # its commit
        self._pending_step: int | None = None
        # Called on rank 0 with the step once its marker is written (maybe from the commit
        # thread): what the trainer reports as its last committed checkpoint.
        self.on_commit: Callable[[int], None] | None = None

    def location(self, step: int) -> str:
        return f"{self.store.uri}/{checkpoint_dir(step)}"

    # ------------------------------------------------------------------ resume

    def resumable(self) -> int | None:
        """Collective: the newest committed checkpoint's step (rank 0 looks)."""
        return dist_utils.broadcast_object(ckpt.find_resumable(self.store) if self.rank == 0 else None)

    def load(self, step: int, model, optimizer) -> ckpt.TrainerState:
        with self.store.read_dir(checkpoint_dir(step), self.attempt) as d:
            state = ckpt.load_dir(d, model, optimizer)
            dist_utils.barrier()  # every local rank has read the node's copy
        return state

    # ------------------------------------------------------------------ save

    def save(self, model, optimizer, state: ckpt.TrainerState, final: bool = False, until: float | None = None,
             stopping: Callable[[], bool] | None = None) -> float:
        """Collective: checkpoint ``state.step``; returns the seconds training was blocked.

        ``final`` waits for the commit and raises when it failed. ``until`` (a
        ``time.monotonic()`` time, set after SIGTERM) bounds everything: waiting for the
        commit still in flight, this one's retries, and the final wait. ``stopping`` ends
        the wait for the commit in flight early (a SIGTERM arrived): that commit carries
        on, queued ahead of this one, and the stop checkpoint's bounded wait covers both.
        """
        t0 = time.perf_counter()
        self.wait(raise_errors=False, until=until, stopping=stopping)
        if self._written is not None:  # it reads the host buffers, and its collectives use our group
            left = None if until is None else max(0.0, until - time.monotonic())
            if not futures.wait([self._written], timeout=left).done:
                raise UploadError("the previous checkpoint's shards were still being written at the stop deadline")
        if final:  # nothing trains after it: write the live tensors, and free the copies of earlier saves
            self._stager.close()
            self._stager = ckpt.host_stager()
        rel = checkpoint_dir(state.step)
        staged = fresh_dir(self.store.local_path(rel, self.rank))  # clears a stale partial one
        dist_utils.barrier()
        self._written = ckpt.start_write(staged, model, optimizer, state, self.rank, None if final else self._stager,
                                         self.group)
        blocked = time.perf_counter() - t0
        written, step = self._written, state.step
        self._pending = self.strategy.submit(lambda: self._publish_and_commit(written, staged, step, until))
        self._pending_step = step
        if final:
            self.wait(raise_errors=True, until=until)
        return blocked

    def _publish_and_commit(self, written: Future, staged: Path, step: int, until: float | None) -> int:
        t0 = time.perf_counter()
        written.result()
        # trainer.upload_timeout_s counts from the shards being on disk, as for a blocking write.
        deadline = min(time.monotonic() + self.deadline_s, until if until is not None else float("inf"))
        files = self.store.publish_dir(staged, checkpoint_dir(step), deadline)
        ckpt.report(self.store, step, self.rank, self.attempt, files, deadline)
        if self.rank != 0:
            return step
        merged = ckpt.gather_reports(self.store, step, self.attempt, self.world, deadline)
        if time.monotonic() > deadline:  # abandoned at the stop deadline: never commit late
            raise UploadError(f"deadline passed before committing step-{step}")
        ckpt.commit(self.store, step, merged, deadline)
        log.info("checkpoint %s committed (%d files, %.2fs after the save)", self.location(step), len(merged),
                 time.perf_counter() - t0)
        if self.on_commit is not None:
            self.on_commit(step)
        pruned = ckpt.prune(self.store, step, self.keep)
        if pruned:
            log.info("pruned checkpoints %s", pruned)
        return step

    def wait(self, raise_errors: bool = True, until: float | None = None,
             stopping: Callable[[], bool] | None = None) -> int | None:
        """Wait for the checkpoint in flight; returns its step when it committed.

        ``until``: stop waiting then and abandon the commit (a fresh thread serves the
        next save); it started no write after ``until`` and writes no marker, so it
        cannot commit later. ``stopping()`` turning true ends the wait but lets the
        commit go on; a failure is still logged when it ends.
        """
        if self._pending is None:
            return None
        future, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if stopping is not None and until is None:
            while not future.done():
                if stopping():
                    log.warning("stopping: not waiting for checkpoint step-%s to commit", step)
                    future.add_done_callback(lambda f: f.exception() and _not_committed(step, f.exception()))
                    return None
                time.sleep(0.2)
        try:
            future.result(timeout=None if until is None else max(0.0, until - time.monotonic()))
            return step
        except FutureTimeout:
            self.strategy.abandon()
            err: Exception = UploadError("commit still running at the stop deadline; abandoned")
        except Exception as e:  # noqa: BLE001 - whatever the write or upload raised
            err = e
        _not_committed(step, err)
        if raise_errors:
            raise err
        return None

    def close(self) -> None:
        """Let the checkpoint in flight finish (end of training, or an error in the loop)."""
        self.wait(raise_errors=False)
        if self._written is not None:
            futures.wait([self._written])
        self._stager.close()


def _not_committed(step: int | None, err: BaseException) -> None:
    log.error("checkpoint step-%s was NOT committed: %s", step, err)
