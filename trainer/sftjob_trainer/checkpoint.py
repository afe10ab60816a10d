"""Sharded, exactly resumable checkpoints with commit markers.

Layout under ``<output_dir>/checkpoints/step-<N>/``: the DCP shards of model and
optimizer (resharded on load, so N processes can resume on M), ``trainer_state.json``
(step, epoch, data cursor, schedule, data fingerprint), ``manifest.json`` (every file
and its size) and last the ``COMMITTED`` marker. A directory without the marker, or
whose manifest does not match its files, is never resumed from. Old checkpoints are
pruned only after a newer one has committed, and the newest good one is never pruned.

RNG: the trainer reseeds every step from (seed, step, rank), so the step number in
``trainer_state.json`` restores the random state exactly, whatever the world size.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sftjob_contract import layout

from . import dist as dist_utils

log = logging.getLogger(__name__)

# One process without a process group is a supported way to run; DCP need not say so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MARKER = layout.COMMITTED
MANIFEST = layout.MANIFEST
STATE = "trainer_state.json"


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps completed
    epoch: int
    cursor: int  # samples of `epoch` already consumed (a global count, independent of world size)
    total_steps: int
    global_batch: int
    data_fingerprint: str
    world_size: int
    tokens_seen: int
    lr_scheduler: str


class LocalCheckpointDir:
    """Checkpoints in a local (or shared) directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, step: int) -> Path:
        return self.root / layout.step_dir(step)

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (layout.parse_step_dir(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(step for step in found if step is not None)

    def is_committed(self, step: int) -> bool:
        return (self.path(step) / MARKER).is_file()

    def verify(self, step: int) -> str | None:
        """None when the checkpoint is complete, else why it is not."""
        d = self.path(step)
        if not (d / MARKER).is_file():
            return "no commit marker"
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError) as err:
            return f"unreadable manifest ({err})"
        for rel, size in manifest.get("files", {}).items():
            f = d / rel
            if not f.is_file() or f.stat().st_size != size:
                return f"file {rel} missing or of the wrong size"
        return None

    def prepare(self, step: int) -> Path:
        """An empty directory for step ``step`` (a stale uncommitted one is cleared first)."""
        d = self.path(step)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def commit(self, step: int) -> None:
        d = self.path(step)
        files = {
            str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file() and p.name != MARKER
        }
        atomic_write(d / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
        atomic_write(d / MARKER, f"{step}\n")

    def prune(self, keep: int) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep`` and stale partial ones."""
        committed = [s for s in self.steps() if self.verify(s) is None]
        if not committed:
            return []
        newest = committed[-1]
        doomed = [s for s in committed[:-keep]] + [s for s in self.steps() if s < newest and s not in committed]
        for s in doomed:
            shutil.rmtree(self.path(s), ignore_errors=True)
        return sorted(doomed)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _options(strict: bool = True) -> StateDictOptions:
    # Frozen base weights (LoRA) come from the base model; only trained ones are saved,
    # so loading them back cannot be strict about the frozen keys.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save(store: LocalCheckpointDir, model, optimizer, state: TrainerState, rank: int, keep: int) -> Path:
    """Collective: every rank writes its shards; rank 0 commits and prunes."""
    d = store.prepare(state.step) if rank == 0 else store.path(state.step)
    dist_utils.barrier()
    write_shards(d, model, optimizer)
    dist_utils.barrier()
    if rank == 0:
        write_state(d, state)
        store.commit(state.step)
        pruned = store.prune(keep)
        if pruned:
            log.info("pruned checkpoints %s", pruned)
    dist_utils.barrier()
    return d


def find_resumable(store: LocalCheckpointDir) -> int | None:
    """The newest complete checkpoint, skipping (and reporting) incomplete ones."""
    for step in reversed(store.steps()):
        why = store.verify(step)
        if why is None:
            return step
        log.warning("ignoring checkpoint %s: %s", store.path(step), why)
    return None


def load(store: LocalCheckpointDir, step: int, model, optimizer) -> TrainerState:
    return load_dir(store.path(step), model, optimizer)


def write_shards(d: Path, model, optimizer) -> None:
    """Collective: every rank writes its DCP shards of model and optimizer into ``d``."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(d))


def write_state(d: Path, state: TrainerState) -> None:
    atomic_write(d / STATE, json.dumps(asdict(state), indent=1))


def load_dir(d: Path, model, optimizer) -> TrainerState:
    """Collective: load a complete checkpoint directory into model and optimizer (resharding)."""
    state = TrainerState(**json.loads((d / STATE).read_text()))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(d))
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"],
                   options=_options(strict=False))
    return state


class LocalCheckpoints:
    """The Checkpointer for a local (or shared) output directory: synchronous saves."""

    def __init__(self, root: Path, rank: int, keep: int):
        self.store = LocalCheckpointDir(root)
        self.rank, self.keep = rank, keep
        self.where = str(root)
        self.on_commit: Callable[[int], None] | None = None  # called with the step once committed

    def resumable(self) -> int | None:
        step = find_resumable(self.store) if self.rank == 0 else None
        return dist_utils.broadcast_object(step)

    def load(self, step: int, model, optimizer) -> TrainerState:
        return load(self.store, step, model, optimizer)

    def save(self, model, optimizer, state: TrainerState, final: bool = False,  # noqa: ARG002
             until: float | None = None, stopping=None) -> float:  # noqa: ARG002
        """Returns the seconds training was blocked (saves here are synchronous)."""
        t0 = time.perf_counter()
        save(self.store, model, optimizer, state, self.rank, self.keep)
        if self.on_commit is not None:
            self.on_commit(state.step)
        return time.perf_counter() - t0

    def wait(self, raise_errors: bool = True, until: float | None = None) -> int | None:  # noqa: ARG002
        """Step of the newest committed checkpoint (saves here are synchronous)."""
        return None

    def location(self, step: int) -> str:
        return str(self.store.path(step))
