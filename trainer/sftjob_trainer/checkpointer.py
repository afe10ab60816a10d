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

A failed commit never passes silently: a permanent cause (storage refusing the writes,
a full disk) ends the run at the next step or save boundary, and so does the
``max_failed_commits``-th failure in a row of any other cause (a success resets the count).
The commit thread only records the failure; the main thread learns of it (``poll``), the
trainer's per-step all-reduce carries the flag to every rank, and every rank then raises
the same error (``end_if_failed``), so none is left waiting in a collective.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from sftjob_contract import exits
from sftjob_contract.layout import CHECKPOINTS, checkpoint_dir

from . import checkpoint as ckpt
from . import dist as dist_utils
from .errors import CheckpointFailed, StorageDenied, Superseded, TrainerError
from .fence import Fence
from .nodecopy import LocalFiles
from .nodecopy import log as downloads_log  # shown on every rank
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
                 strategy: CommitStrategy | None = None, max_failed_commits: int = 3):
        self.store, self.rank, self.world, self.keep, self.deadline_s = store, rank, world, keep, deadline_s
        self.max_failed_commits = max_failed_commits
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
        # Called from the main thread with the step of each commit this rank saw fail.
        self.on_failed_commit: Callable[[int], None] | None = None
        self.failed_in_a_row = 0
        self.failed_step: int | None = None  # the newest step whose commit failed
        self._failure: Exception | None = None  # what ends the run, held until every rank knows
        self.fence: Fence | None = None  # rank 0's claim on the prefix (fence.py); None: unfenced
        # trainer.export=best: never prune the checkpoint of the best validation a save's state
        # names (TrainerState.best_val_step): the export loads its weights at the end.
        self.keep_best = False
        self._ended = False
        self._restore = contextlib.ExitStack()  # the node's copy of the checkpoint a resume reads
        self._prefetched: tuple[int, LocalFiles] | None = None

    def location(self, step: int) -> str:
        return f"{self.store.uri}/{checkpoint_dir(step)}"

    # ------------------------------------------------------------------ resume

    def resumable(self) -> int | None:
        """Collective: the newest committed checkpoint's step (rank 0 looks)."""
        return dist_utils.broadcast_object(ckpt.find_resumable(self.store) if self.rank == 0 else None)

    def committed(self, step: int) -> bool:
        """Collective: is ``step`` a complete, committed checkpoint (rank 0 looks)?"""
        return bool(dist_utils.broadcast_object(ckpt.verify(self.store, step) is None if self.rank == 0 else None))

    def prefetch(self, step: int) -> None:
        """Start fetching this rank's own shard files of checkpoint ``step`` in the background,
        while the model and the optimizer are built; ``load(step)`` reads what came and fetches
        only the rest. Only where the world size is the one that saved it, so that a rank loads
        its own files: the restart gap of a preemption, overlapped with the build. A failure
        here costs only the overlap: the load fetches what it reads, and fails as it would."""
        files = self._restore.enter_context(self.store.read_dir(checkpoint_dir(step), self.attempt))
        self._prefetched = (step, files)   # load(step) reads this copy, prefetched or not
        try:
            files.fetch([ckpt.TRAINER_STATE])
            saved = json.loads((files.dir / ckpt.TRAINER_STATE).read_text()).get("world_size")
            own = {n: [(0, size)] for n, size in files.sizes().items()
                   if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")}
        except Exception as err:  # noqa: BLE001 - the load reports storage failures, classified
            log.warning("not prefetching checkpoint step-%d (%s): the load fetches what it reads", step, err)
            return
        if saved != self.world or not own:
            return
        downloads_log.info("prefetching %d bytes of checkpoint step-%d (this rank's shards) while the model is built",
                           sum(r[0][1] for r in own.values()), step)

        def fetch() -> None:
            try:
                files.fetch_ranges(own)
            except Exception as err:  # noqa: BLE001 - as above
                log.warning("prefetching checkpoint step-%d failed (%s): the load fetches what it reads", step, err)

        thread = threading.Thread(target=fetch, name="ckpt-prefetch", daemon=True)
        thread.start()
        self._restore.callback(thread.join)   # never remove the copy under a running fetch

    def load(self, step: int, model, optimizer) -> ckpt.TrainerState:
        with self._restore:
            if self._prefetched is not None and self._prefetched[0] == step:
                files = self._prefetched[1]
            else:
                files = self._restore.enter_context(self.store.read_dir(checkpoint_dir(step), self.attempt))
            self._prefetched = None
            state = ckpt.load_dir(files, model, optimizer)
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
        flag = torch.tensor([float(self._failure is not None)])
        self.end_if_failed(bool(dist_utils.all_reduce_max(flag).item()))
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
        pinned = state.best_val_step if self.keep_best and state.best_val_step >= 0 else None
        self._pending = self.strategy.submit(lambda: self._publish_and_commit(written, staged, step, until, pinned))
        self._pending_step = step
        if final:
            self.wait(raise_errors=True, until=until)
        return blocked

    def _publish_and_commit(self, written: Future, staged: Path, step: int, until: float | None,
                            pinned: int | None = None) -> int:
        t0 = time.perf_counter()
        written.result()
        # trainer.upload_timeout_s counts from the shards being on disk, as for a blocking write.
        deadline = min(time.monotonic() + self.deadline_s, until if until is not None else float("inf"))
        try:
            files = self.store.publish_dir(staged, checkpoint_dir(step), deadline)
            ckpt.report(self.store, step, self.rank, self.attempt, files, deadline)
        except Exception as err:
            # Rank 0 would otherwise wait for this rank's report until the upload deadline.
            ckpt.report_failure(self.store, step, self.rank, self.attempt, err, deadline)
            raise
        if self.rank != 0:
            return step
        merged = ckpt.gather_reports(self.store, step, self.attempt, self.world, deadline)
        if time.monotonic() > deadline:  # abandoned at the stop deadline: never commit late
            raise UploadError(f"deadline passed before committing step-{step}")
        if self.fence is not None:
            self.fence.check(f"commit checkpoint step-{step}")
        ckpt.commit(self.store, step, merged, deadline)
        log.info("checkpoint %s committed (%d files, %.2fs after the save)", self.location(step), len(merged),
                 time.perf_counter() - t0)
        if self.on_commit is not None:
            self.on_commit(step)
        if self.fence is not None:  # a stale attempt must not delete what the current one resumes from
            self.fence.check("prune older checkpoints")
        try:
            pruned = ckpt.prune(self.store, step, self.keep, pinned)
        except Exception as err:  # noqa: BLE001 - step is committed: not a failed commit; the next one retries
            log.warning("checkpoint %s committed, but pruning older ones failed: %s", self.location(step), err)
        else:
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
        assert step is not None  # set together with _pending
        self._pending = self._pending_step = None
        if stopping is not None and until is None:
            def log_failure(f: Future) -> None:
                if (err := f.exception()) is not None:
                    _not_committed(step, err)

            while not future.done():
                if stopping():
                    log.warning("stopping: not waiting for checkpoint step-%s to commit", step)
                    future.add_done_callback(log_failure)
                    return None
                time.sleep(0.2)
        try:
            future.result(timeout=None if until is None else max(0.0, until - time.monotonic()))
            self.failed_in_a_row = 0
            return step
        except FutureTimeout:
            self.strategy.abandon()
            err: Exception = UploadError("commit still running at the stop deadline; abandoned")
        except Exception as e:  # noqa: BLE001 - whatever the write or upload raised
            err = e
        err = self._failed(step, err)
        if raise_errors:
            raise err
        return None

    # ------------------------------------------------------------------ failed commits

    def _failed(self, step: int, err: Exception) -> Exception:
        """Count a commit that failed; remember what must end the run. Returns ``err``,
        or the plain error it stands for (a full disk reported as OSError)."""
        if isinstance(err, OSError) and err.errno in ckpt.DISK_FULL_ERRNOS:
            err = ckpt.io_error("publishing checkpoint", self.store.local_path(checkpoint_dir(step), self.rank),
                                err)
        _not_committed(step, err)
        self.failed_in_a_row += 1
        self.failed_step = step
        if self.on_failed_commit is not None:
            self.on_failed_commit(step)
        if self._failure is None:
            if _ends_the_run_at_once(err):
                self._failure = err
            elif self.failed_in_a_row >= self.max_failed_commits:
                self._failure = CheckpointFailed(
                    f"{self.failed_in_a_row} checkpoint commits in a row failed, the last (step-{step}) with: {err}. "
                    f"Training on would only add work that a restart loses: check that spec.storage.uri "
                    f"({self.store.uri}) is reachable and accepts writes (the limit is "
                    f"spec.training.maxFailedCommits={self.max_failed_commits})")
        return err

    def poll(self) -> bool:
        """At a step boundary, without blocking: settle the commit in flight if it has ended.
        True when this rank holds a failure that ends the run: pass the sum over ranks to
        ``end_if_failed``."""
        if self._pending is not None and self._pending.done():
            self.wait(raise_errors=False)
        return self._failure is not None

    def end_if_failed(self, failed_anywhere: bool) -> None:
        """Collective when ``failed_anywhere`` (every rank passes the same value): every rank
        raises the same error, the first rank's that holds one, a permanent one first."""
        if not failed_anywhere:
            return
        mine = self._failure
        held = dist_utils.all_gather_objects(
            None if mine is None else (_permanent(mine), type(mine).__name__, str(mine)))
        _, src, (_, kind, message) = min((not h[0], r, h) for r, h in enumerate(held) if h is not None)
        self._ended = True
        if src == self.rank and mine is not None:
            raise mine
        raise _KINDS.get(kind, CheckpointFailed)(message)

    def close(self) -> None:
        """Let the checkpoint in flight finish (end of training, or an error in the loop);
        not after a failed commit ended the run: that one may wait for a store that fails."""
        if self._ended:
            self.strategy.abandon()
            self._pending = self._pending_step = None
        self.wait(raise_errors=False)
        if self._written is not None:
            futures.wait([self._written])
        self._stager.close()
        self._restore.close()


def _not_committed(step: int, err: BaseException) -> None:
    log.error("checkpoint step-%s was NOT committed: %s", step, err)


def _permanent(err: BaseException) -> bool:
    return getattr(err, "exit_code", exits.FAILED) == exits.PERMANENT


def _ends_the_run_at_once(err: BaseException) -> bool:
    """A cause that the next commit meets again: the store refuses, or the disk is full."""
    return isinstance(err, (StorageDenied, Superseded)) or (isinstance(err, ckpt.CheckpointIOError) and err.disk_full)


# The errors a rank can hold when the run ends, rebuilt by name on the ranks that did not see it.
_KINDS: dict[str, type[TrainerError]] = {c.__name__: c for c in (StorageDenied, Superseded, CheckpointFailed,
                                                                  ckpt.CheckpointIOError)}
