"""Weights & Biases through the `wandb` package: one run per job, resumed by its id.

The run id is derived from the job's identity (``RunInfo.identity``), so every attempt of a
job opens the same run (``resume="allow"``). Online, W&B says where a resumed run stands
(``starting_step``: the step after the last one it holds), and the Tracker logs only steps
above it. Offline (``mode: offline``, files under WANDB_DIR for a later `wandb sync`) each
attempt writes its own directory under the same id; W&B keeps a run's steps increasing when
they are synced, so a step re-trained after a resume is kept once. The API key comes only
from WANDB_API_KEY, which the operator fills from the Secret; wandb reads it itself.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sftjob_contract.tracking import WandbConfig

from .track_base import ALL, OUTPUT_URI, RunInfo

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

INIT_TIMEOUT_S = 10.0   # an unreachable server delays the start by this much, then training goes on without it
# A .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB log blocks of 32 KiB,
# each record in chunks with a 7-byte header (crc32, length, type: full, first, middle, last).
_HEADER, _BLOCK, _CHUNK = 7, 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator:
    """The wandb_internal_pb2.Record messages of one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, parts = _HEADER, b""
    while pos + _CHUNK <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK:   # too little room for a chunk header: the block is padded
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK])
        chunk, pos = data[pos + _CHUNK:pos + _CHUNK + length], pos + _CHUNK + length
        if kind in (_FULL, _LAST):
            # wandb ships py.typed but no .pyi for its generated protobuf modules, whose message
            # classes protobuf's builder adds to the module's globals at import time.
            record = pb.Record()  # type: ignore[attr-defined]  # made at import: no .pyi, see above
            record.ParseFromString(parts + chunk if kind == _LAST else chunk)
            parts = b""
            yield record
        elif kind in (_FIRST, _MIDDLE):
            parts = chunk if kind == _FIRST else parts + chunk
        else:   # a zero-filled tail: nothing more was written
            pos += left - _CHUNK - length


def history(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(step, {metric: JSON value}) of every history row of one .wandb file."""
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            yield r.history.step.num, {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}


def offline_last_step(sync_dir: Path, rid: str) -> int:
    """The last step the earlier offline attempts of run ``rid`` wrote (0: none)."""
    runs = [d for d in Path(sync_dir).parent.glob(f"offline-run-*-{rid}") if d != Path(sync_dir)]
    return max((step for d in runs for f in d.glob("*.wandb") for step, _ in history(f)), default=0)


def run_id(run: RunInfo) -> str:
    """W&B run ids: letters, digits, - and _, at most 64 characters."""
    return f"sftjob-{run.identity}"


class Wandb:
    name = "wandb"

    def __init__(self, cfg: WandbConfig):
        self.cfg = cfg
        self.run: Run | None = None   # opened by start()

    def start(self, run: RunInfo, params: dict[str, str]) -> dict[str, int]:
        import wandb

        settings = wandb.Settings(console="off", disable_git=True, save_code=False, x_disable_stats=True,
                                  init_timeout=INIT_TIMEOUT_S)
        self.run = wandb.init(project=self.cfg.project or "sftjob", entity=self.cfg.entity, id=run_id(run),
                              resume="allow", name=run.name, mode=self.cfg.mode, config=params, settings=settings)
        last = int(self.run.starting_step or 0) - 1
        if self.cfg.mode == "offline":
            last = offline_last_step(Path(self.run.settings.sync_dir), run_id(run))
        return {ALL: last} if last > 0 else {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self.run is not None  # the Tracker logs to a backend only after its start()
        self.run.log(metrics, step=step)

    def commit(self) -> None:
        """wandb streams (or writes) every log itself."""

    def finish(self, status: str, output_uri: str | None) -> None:
        if self.run is None:
            return
        if output_uri:
            self.run.summary[OUTPUT_URI] = output_uri
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        self.run = None
