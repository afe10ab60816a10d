"""The run's output location: a local directory or an s3:// prefix, one interface.

Files are always produced on local disk first (``local``); for an s3:// output they are
then published under the same relative path, so both layouts are identical
(sftjob_contract.layout): ``metrics.jsonl``, ``checkpoints/step-<N>/``, ``hf/final``, ``hf/adapter``.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sftjob_contract import layout

from .checkpoint import LocalCheckpoints, atomic_write
from .storage import S3Prefix, is_s3, local_root

log = logging.getLogger(__name__)


class Outputs:
    def __init__(self, output_dir: str, rank: int, world: int, keep: int, upload_deadline_s: float):
        self.uri = output_dir.rstrip("/")
        self.remote = is_s3(output_dir)
        self.rank = rank
        if self.remote:
            from .s3checkpoint import S3Checkpoints

            self.local = local_root(self.uri)
            self.s3 = S3Prefix(self.uri, deadline_s=upload_deadline_s)
            self.checkpoints = S3Checkpoints(self.uri, self.local, rank, world, keep, upload_deadline_s)
        else:
            self.local = Path(output_dir)
            self.s3 = None
            self.checkpoints = LocalCheckpoints(self.local / layout.CHECKPOINTS, rank, keep)

    def location(self, rel: str) -> str:
        return f"{self.uri}/{rel}"

    # The data scan cache (data.ScanCache): derived files under cache/, only ever a shortcut.

    def get(self, name: str) -> bytes | None:
        try:
            if self.remote:
                return self.s3.get_bytes(f"{layout.CACHE}/{name}")
            path = self.local / layout.CACHE / name
            return path.read_bytes() if path.exists() else None
        except Exception as err:  # noqa: BLE001 - without the cache the scan just runs again
            log.warning("cannot read cache/%s (%s); recomputing it", name, err)
            return None

    def put(self, name: str, data: bytes) -> None:
        try:
            if self.remote:
                self.s3.put_bytes(f"{layout.CACHE}/{name}", data)
                return
            path = self.local / layout.CACHE / name
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
        except Exception as err:  # noqa: BLE001
            log.warning("cannot write cache/%s (%s); the next start scans the data again", name, err)

    def restore_metrics(self) -> None:
        """Continue the remote metrics.jsonl after a restart instead of starting a new one."""
        if not (self.remote and self.rank == 0):
            return
        text = self.s3.get_text(layout.METRICS_FILE)
        path = self.local / layout.METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text or "")

    def publish_metrics(self) -> None:
        if self.remote and self.rank == 0 and (self.local / layout.METRICS_FILE).exists():
            self.s3.upload_file(self.local / layout.METRICS_FILE, layout.METRICS_FILE)

    def publish_dir(self, rel: str) -> str:
        """Upload ``local/rel`` (rank 0's export) and return its final location."""
        if self.remote and self.rank == 0:
            self.s3.delete_dir(rel)
            self.s3.upload_dir(self.local / rel, rel)
            shutil.rmtree(self.local / rel, ignore_errors=True)
        return self.location(rel)
