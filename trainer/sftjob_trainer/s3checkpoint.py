"""Checkpoints committed to S3, uploaded in the background.

Training blocks only while the DCP shards are written to node-local disk. Then each
rank uploads its own files in a background thread (parallel, multipart, retried, with a
deadline) and reports them in ``_ranks/rank-<r>.json``; rank 0 waits for every rank's
report of this attempt, then writes ``manifest.json``, then the ``COMMITTED`` marker,
then the ``checkpoints/latest`` pointer, in that order, and only then prunes older
checkpoints. Resume takes the newest checkpoint whose marker and manifest verify against
the objects (``latest`` is only a pointer for people and tools). No collective runs in the
background thread.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from . import dist as dist_utils
from .checkpoint import MANIFEST, MARKER, TrainerState, load_dir, write_shards, write_state
from .storage import S3Prefix, UploadError, fetch_once

log = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)/")


class S3Checkpoints:
    def __init__(self, output_uri: str, local_root: Path, rank: int, world: int, keep: int, deadline_s: float = 600.0):
        self.s3 = S3Prefix(output_uri, deadline_s=deadline_s)
        self.local_root, self.rank, self.world, self.keep = local_root, rank, world, keep
        self.deadline_s = deadline_s
        self.where = f"{self.s3.uri}/checkpoints"
        # Reports left by an earlier attempt at the same step must not count for this one.
        self.attempt = dist_utils.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: Future | None = None
        self._pending_step: int | None = None
        # Called on rank 0 with the step once its marker is written (from the upload thread):
        # what the trainer reports as its last committed checkpoint.
        self.on_commit: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ resume

    def _committed_candidates(self) -> list[int]:
        steps = {int(m.group(1)) for name in self.s3.list("checkpoints") if (m := _STEP.match(name))}
        return sorted(steps, reverse=True)

    def verify(self, step: int) -> str | None:
        objects = self.s3.list(f"checkpoints/step-{step}")
        if MARKER not in objects:
            return "no commit marker"
        try:
            manifest = json.loads(self.s3.get_text(f"checkpoints/step-{step}/{MANIFEST}") or "")
            files = manifest["files"]
        except (ValueError, KeyError, TypeError) as err:
            return f"unreadable manifest ({err})"
        for rel, size in files.items():
            if objects.get(rel) != size:
                return f"object {rel} missing or of the wrong size"
        return None

    def _find(self) -> int | None:
        # The newest checkpoint that verifies, whatever `latest` says: `latest` is a pointer
        # for people and tools, and an upload abandoned at a stop deadline could still move
        # it back if its process lived on.
        for step in self._committed_candidates():
            why = self.verify(step)
            if why is None:
                return step
            log.warning("ignoring checkpoint %s/step-%d: %s", self.where, step, why)
        return None

    def resumable(self) -> int | None:
        return dist_utils.broadcast_object(self._find() if self.rank == 0 else None)

    def load(self, step: int, model, optimizer) -> TrainerState:
        # Keyed by this attempt, so a copy left on the node by an earlier run is never reused.
        dest = fetch_once(f"{self.where}/step-{step}", self.local_root / "restore" / self.attempt / f"step-{step}")
        state = load_dir(dest, model, optimizer)
        dist_utils.barrier()
        shutil.rmtree(dest.parent, ignore_errors=True)
        return state

    # ------------------------------------------------------------------ save

    def save(self, model, optimizer, state: TrainerState, final: bool = False, until: float | None = None,
             stopping: Callable[[], bool] | None = None) -> float:
        """Write shards locally (blocking, collective), upload and commit in the background.

        Returns the seconds training was blocked. ``final`` waits for the commit and
        raises when it failed. ``until`` (a ``time.monotonic()`` time, set after SIGTERM)
        bounds everything: waiting for the upload still in flight, the retries of this one,
        and the final wait. ``stopping`` ends the wait for the upload in flight early (a
        SIGTERM arrived): that upload carries on, queued ahead of this one, and the stop
        checkpoint's bounded wait then covers both.
        """
        self.wait(raise_errors=False, until=until, stopping=stopping)
        t0 = time.perf_counter()
        d = self.local_root / f"rank-{self.rank}" / f"step-{state.step}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        write_shards(d, model, optimizer)
        if self.rank == 0:
            write_state(d, state)
        blocked = time.perf_counter() - t0
        deadline = min(time.monotonic() + self.deadline_s, until if until is not None else float("inf"))
        self._pending = self._pool.submit(self._upload_and_commit, d, state.step, deadline)
        self._pending_step = state.step
        if final:
            self.wait(raise_errors=True, until=until)
        return blocked

    def _upload_and_commit(self, d: Path, step: int, deadline: float) -> int:
        t0 = time.perf_counter()
        rel = f"checkpoints/step-{step}"
        files = self.s3.upload_dir(d, rel, deadline)
        self.s3.put_text(f"{rel}/_ranks/rank-{self.rank}.json", json.dumps({"attempt": self.attempt, "files": files}),
                         deadline)
        if self.rank == 0:
            merged = self._gather_reports(rel, deadline)
            self.s3.put_text(f"{rel}/{MANIFEST}", json.dumps({"step": step, "files": merged}, indent=1), deadline)
            self.s3.put_text(f"{rel}/{MARKER}", f"{step}\n", deadline)
            self.s3.put_text("checkpoints/latest", f"{step}\n", deadline)
            log.info("checkpoint %s/step-%d committed (%d files, upload %.2fs)", self.where, step, len(merged),
                     time.perf_counter() - t0)
            if self.on_commit is not None:
                self.on_commit(step)
            self._prune(step)
        shutil.rmtree(d, ignore_errors=True)
        return step

    def _gather_reports(self, rel: str, deadline: float) -> dict[str, int]:
        while True:
            reports = {}
            for name in self.s3.list(f"{rel}/_ranks"):
                body = json.loads(self.s3.get_text(f"{rel}/_ranks/{name}") or "{}")
                if body.get("attempt") == self.attempt:
                    reports[name] = body["files"]
            if len(reports) == self.world:
                merged: dict[str, int] = {}
                for files in reports.values():
                    merged.update(files)
                return merged
            if time.monotonic() > deadline:
                raise UploadError(f"{rel}: only {len(reports)} of {self.world} ranks uploaded their shards in time")
            time.sleep(0.2)

    def _prune(self, newest: int) -> None:
        """Only after ``newest`` committed: drop committed ones beyond ``keep`` and older partials."""
        committed = [s for s in self._committed_candidates() if s <= newest and self.verify(s) is None]
        keep = set(committed[: self.keep]) | {newest}
        for step in self._committed_candidates():
            if step < newest and step not in keep:
                self.s3.delete_dir(f"checkpoints/step-{step}")
                log.info("pruned %s/step-%d", self.where, step)

    def wait(self, raise_errors: bool = True, until: float | None = None,
             stopping: Callable[[], bool] | None = None) -> int | None:
        """Wait for the checkpoint in flight; returns its step when it committed.

        ``until``: stop waiting then and abandon the upload (a fresh thread serves the next
        save). An upload whose own deadline is ``until`` (the stop checkpoint) starts no
        write after it, so it cannot commit later. ``stopping()`` turning true ends the wait
        but lets the upload go on; a failure is still logged when it ends.
        """
        if self._pending is None:
            return None
        future, step = self._pending, self._pending_step
        self._pending = self._pending_step = None
        if stopping is not None and until is None:
            while not future.done():
                if stopping():
                    log.warning("stopping: not waiting for checkpoint step-%s to finish uploading", step)
                    future.add_done_callback(lambda f: f.exception() and self._not_committed(step, f.exception()))
                    return None
                time.sleep(0.2)
        try:
            future.result(timeout=None if until is None else max(0.0, until - time.monotonic()))
            return step
        except FutureTimeout:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
            err: Exception = UploadError("upload still running at the stop deadline; abandoned")
        except Exception as e:  # noqa: BLE001 - whatever the upload raised
            err = e
        self._not_committed(step, err)
        if raise_errors:
            raise err
        return None

    @staticmethod
    def _not_committed(step: int, err: BaseException) -> None:
        log.error("checkpoint step-%s was NOT committed: %s", step, err)

    def location(self, step: int) -> str:
        return f"{self.where}/step-{step}"
