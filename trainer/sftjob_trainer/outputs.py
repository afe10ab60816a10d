"""The run's outputs: one ``storage.Store`` (a local directory or an s3:// prefix) and
the layout (``layout``) the operator and users read.

Files are produced on local disk first (``Store.local_path``) and then published under
the same relative path, so both kinds of output look the same: ``metrics.jsonl``,
``checkpoints/step-<N>/``, ``cache/``, ``hf/final``, ``hf/adapter``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from sftjob_contract.layout import CACHE, METRICS_FILE

from . import dist as dist_utils
from .checkpointer import Checkpointer
from .fence import Fence, attempt_from_env
from .storage import Store, atomic_write, fresh_dir, open_store

log = logging.getLogger(__name__)


class Outputs:
    def __init__(self, store: Store, rank: int, world: int, keep: int, upload_deadline_s: float,
                 max_failed_commits: int = 3):
        self.store, self.rank = store, rank
        self.checkpoints = Checkpointer(store, rank, world, keep, upload_deadline_s,
                                        max_failed_commits=max_failed_commits)
        # Rank 0 claims the prefix for this attempt before anything reads or writes it; a
        # newer attempt's claim stops this one before its next commit, prune or export.
        self.fence = Fence.claim(store, attempt_from_env(), self.checkpoints.attempt) if rank == 0 else None
        self.checkpoints.fence = self.fence

    @classmethod
    def open(cls, output_dir: str, rank: int, world: int, keep: int, upload_deadline_s: float,
             max_failed_commits: int = 3) -> Outputs:
        return cls(open_store(output_dir.rstrip("/"), upload_deadline_s), rank, world, keep, upload_deadline_s,
                   max_failed_commits)

    def location(self, rel: str) -> str:
        return f"{self.store.uri}/{rel}"

    # The data scan cache (data.ScanCache): derived files under cache/, only ever a shortcut.

    def get(self, name: str) -> bytes | None:
        try:
            return self.store.get_bytes(f"{CACHE}/{name}")
        except Exception as err:  # noqa: BLE001 - without the cache the scan just runs again
            log.warning("cannot read %s/%s (%s); recomputing it", CACHE, name, err)
            return None

    def put(self, name: str, data: bytes) -> None:
        try:
            self.store.put_bytes(f"{CACHE}/{name}", data)
        except Exception as err:  # noqa: BLE001 - the cache is only a shortcut
            log.warning("cannot write %s/%s (%s); the next start scans the data again", CACHE, name, err)

    # metrics.jsonl: appended locally by rank 0, published after each checkpoint and at the end.

    @property
    def metrics_path(self) -> Path:
        return self.store.local_path(METRICS_FILE)

    def restore_metrics(self) -> None:
        """Rank 0: continue the published metrics.jsonl after a restart instead of starting a new one."""
        if self.rank != 0:
            return
        body = self.store.get_bytes(METRICS_FILE)
        path = self.metrics_path
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, body or b"")

    def publish_metrics(self) -> None:
        if self.rank == 0 and self.metrics_path.exists():
            self.store.publish_file(self.metrics_path, METRICS_FILE)

    def write_dir(self, rel: str, write: Callable[[Path], object]) -> str:
        """Collective: every rank calls ``write`` with a fresh local directory; rank 0's
        content then replaces ``rel``. Returns the published location."""
        if self.fence is not None:  # before anything is cleared: a local store writes in place
            self.fence.check(f"write {rel}/")
        staged = fresh_dir(self.store.local_path(rel))
        dist_utils.barrier()  # no rank writes before every rank has cleared its copy
        write(staged)
        if self.rank == 0:
            if self.fence is not None:
                self.fence.check(f"publish {rel}/")
            self.store.publish_dir(staged, rel, replace=True)
        dist_utils.barrier()
        return self.location(rel)
