"""TensorBoard: event files written locally, published under <output_dir>/tensorboard/.

The writer (torch.utils.tensorboard, backed by the `tensorboard` package) appends to a file
on local disk (``Store.local_path``: for a local output directory that is the target
itself); ``commit`` copies the files into the run's store at every checkpoint commit and at
the end, so `tensorboard --logdir <output_dir>/tensorboard` (s3:// included) shows the run.

Each attempt writes a file of its own (the writer names it by time, host and pid) into the
same directory, and TensorBoard reads the directory's files as one run. ``start`` reads the
files already published, with TensorBoard's own reader, to say the last step each tag holds,
so that the Tracker does not log a step twice after a resume.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .track_base import RunInfo

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

DIR = "tensorboard"


def last_steps(logdir: Path) -> dict[str, int]:
    """{tag: its highest step} over every event file in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: max(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()[SCALARS] if acc.Scalars(tag)}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, store):
        self.store = store
        self.writer: SummaryWriter | None = None   # opened by start()
        self.local: Path | None = None

    def start(self, run: RunInfo, params: dict[str, str]) -> dict[str, int]:  # run: one dir per job
        from torch.utils.tensorboard import SummaryWriter

        published = self.store.list(DIR)
        with tempfile.TemporaryDirectory() as tmp:
            for name in published:
                body = self.store.get_bytes(f"{DIR}/{name}")
                if body is not None:
                    (Path(tmp) / Path(name).name).write_bytes(body)
            last = last_steps(Path(tmp)) if published else {}
        self.local = self.store.local_path(DIR)
        self.local.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.local))
        if not published:
            self.writer.add_text("params", "\n".join(f"    {k} = {v}" for k, v in sorted(params.items())), 0)
        return last

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self.writer is not None  # the Tracker logs to a backend only after its start()
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def commit(self) -> None:
        if self.writer is None or self.local is None:
            return
        self.writer.flush()
        for path in sorted(self.local.glob("events.out.tfevents.*")):
            self.store.publish_file(path, f"{DIR}/{path.name}")

    def finish(self, status: str, output_uri: str | None) -> None:
        if self.writer is None:
            return
        self.commit()
        self.writer.close()
        self.writer = None
