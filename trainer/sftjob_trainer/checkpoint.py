"""What makes a checkpoint: its files, its commit protocol, and how it is found again.

Layout under ``<output>/checkpoints/step-<N>/`` (``layout``): the DCP shards of model and
optimizer (resharded on load, so N processes can resume on M), ``trainer_state.json``
(step, epoch, data cursor, schedule, data fingerprint), one report per rank under
``_ranks/`` (what it published, tagged with the run's attempt), then, written by rank 0
in this order, ``manifest.json`` (every file and its size), the ``COMMITTED`` marker and
``checkpoints/latest``. A checkpoint without the marker, or whose manifest does not match
its files, is never resumed from. Old checkpoints are pruned only after a newer one has
committed, and the newest good one is never pruned.

Every function here works on a ``storage.Store``, so the same code serves a local
directory and an s3:// prefix, and tests run it against a local directory.

RNG: the trainer reseeds every step from (seed, step, rank), so the step number in
``trainer_state.json`` restores the random state exactly, whatever the world size.
"""
from __future__ import annotations

import errno
import json
import logging
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from sftjob_contract.layout import (CHECKPOINTS, COMMITTED, LATEST, MANIFEST, RANK_REPORTS, TRAINER_STATE,
                                    checkpoint_dir, parse_step_dir)
from .errors import TrainerError
from .nodecopy import LocalFiles
from .storage import Store, UploadError, atomic_write

log = logging.getLogger(__name__)

# One process without a process group is a supported way to run; DCP need not say so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")



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
    # Optimizer steps in a row, up to this one, skipped for a non-finite loss or gradient
    # (trainer.max_non_finite_steps); kept so a restart cannot reset the count.
    non_finite_in_a_row: int = 0
    # Validation (early_stop.py), kept so a restart continues early stopping exactly and
    # export=best still knows its checkpoint: the last validation's step and loss, the lowest
    # loss and its step, and validations in a row without an improvement over min_delta.
    val_step: int = -1
    val_loss: float | None = None
    best_val_step: int = -1
    best_val_loss: float | None = None
    val_without_improvement: int = 0


# --------------------------------------------------------------------------- shards (DCP)


def _options(strict: bool = True) -> StateDictOptions:
    # Frozen base weights (LoRA) come from the base model; only trained ones are saved,
    # so loading them back cannot be strict about the frozen keys.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def host_stager() -> DefaultStager:
    """Copies shards into host buffers kept from one save to the next (pinned when a GPU
    is there), so only the first save pays for allocating them. A buffer is reused only
    after the previous save's write has finished (``Checkpointer.save`` waits for it)."""
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


FULL_BELOW = 2 * 2**20  # bytes free under which a failed write is put down to a full disk
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointIOError(TrainerError):
    """A checkpoint's shards could not be written or read, with each rank's cause.
    ``disk_full``: the cause is a full file system, which the next save meets again."""

    def __init__(self, message: str, disk_full: bool = False):
        super().__init__(message)
        self.disk_full = disk_full


def io_error(action: str, d: Path, err: BaseException) -> CheckpointIOError:
    """``err`` as a plain error naming ``d``, each failed rank's cause and a full disk.
    torch.distributed.checkpoint raises CheckpointException, a BaseException that would pass
    every ``except Exception`` and end the rank with a raw traceback and no reason."""
    failures = getattr(err, "failures", None)  # CheckpointException: rank -> (exception, stack)
    causes = {r: (f[0] if isinstance(f, tuple) else f) for r, f in sorted(failures.items())} \
        if isinstance(failures, dict) else {None: err}
    parts = [f"{'' if r is None else f'rank {r}: '}{type(c).__name__}: {c}" for r, c in causes.items()]
    msg = f"{action} {d} failed: {'; '.join(parts)}"
    free = shutil.disk_usage(next(p for p in (d, *d.parents) if p.exists())).free
    # torch's file writer can report a full disk as a bare "unexpected pos": judge by the disk too
    full = free < FULL_BELOW or any(isinstance(c, OSError) and c.errno in DISK_FULL_ERRNOS for c in causes.values())
    if full:
        msg += (f" (the file system holding {d} is full: {free // 2**20} MiB free; give it more space: the volume "
                "of spec.storage.persistentVolumeClaim for a path spec.storage.uri, the pod's scratch volume "
                "(spec.resources.scratch.size; SFTJOB_LOCAL_DIR) for an s3:// one; or keep fewer checkpoints with "
                "spec.checkpoint.keep "
                "(trainer.keep_checkpoints))")
    return CheckpointIOError(msg, disk_full=full)


def _plain_errors(written: Future, d: Path) -> Future:
    """A future of ``written`` that fails with io_error()'s error instead of dcp's."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(f.result())
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out.set_exception(io_error("writing checkpoint", d, e))

    written.add_done_callback(done)
    return out


def start_write(d: Path, model, optimizer, state: TrainerState, rank: int, stager: DefaultStager | None,
                group=None) -> Future:
    """Collective: copy this rank's shards to host memory (the only blocking part; skipped
    with ``stager=None``, below) and write them into ``d`` in a background thread; the
    future ends when every rank's shards are on disk. ``group`` must be a CPU (gloo) group
    that training does not use, since its collectives run beside the training step's.
    Rank 0 also writes the state.

    ``stager=None``: no copy; the thread writes the live tensors, so the caller must not
    change them until the future ends (a final save: nothing trains after it)."""
    try:
        if rank == 0:
            atomic_write(d / TRAINER_STATE, json.dumps(asdict(state), indent=1))
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
        shards = {"model": model_sd, "optim": optim_sd}
        if stager is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
            written = pool.submit(dcp.save, shards, checkpoint_id=str(d), process_group=group)
            pool.shutdown(wait=False)
        else:
            saved = dcp.async_save(shards, checkpoint_id=str(d), process_group=group, async_stager=stager)
            # An AsyncSaveResponse comes only from asynchronous staging; host_stager() stages in this call.
            assert isinstance(saved, Future)
            written = saved
    except (OSError, CheckpointException) as e:  # dcp's planning collectives raise the latter
        raise io_error("writing checkpoint", d, e) from None
    return _plain_errors(written, d)


class NodeLocalReader(FileSystemReader):
    """DCP's file reader over ``files`` (a ``nodecopy.LocalFiles``): before DCP reads the
    metadata or this rank's chunks, it asks for exactly those, so a remote checkpoint is
    never fetched whole: the metadata says which file and byte range holds each chunk, and
    the load plan which chunks this rank loads (after resharding, when the world changed)."""

    def __init__(self, files: LocalFiles):
        super().__init__(files.dir)
        self.files = files

    def read_metadata(self, *args, **kwargs):
        self.files.fetch([Path(self._get_metadata_path(kwargs.get("rank"))).name])
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        self.files.fetch_ranges(ranges)
        return super().read_data(plan, planner)


def load_dir(files: LocalFiles, model, optimizer) -> TrainerState:
    """Collective: load a complete checkpoint (``Store.read_dir``) into model and optimizer
    (resharding), reading only what this rank needs of it."""
    files.fetch([TRAINER_STATE])
    state = TrainerState(**json.loads((files.dir / TRAINER_STATE).read_text()))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    target = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(target, storage_reader=NodeLocalReader(files))
    except CheckpointException as e:
        raise io_error("reading checkpoint", files.dir, e) from None
    # dcp.load loaded into model_sd and optim_sd in place (target holds them, not copies).
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=_options(strict=False))
    return state


# --------------------------------------------------------------------------- commit protocol


def report(store: Store, step: int, rank: int, attempt: str, files: dict[str, int],
           deadline: float | None = None) -> None:
    """Say which files this rank published for ``step`` (in this attempt)."""
    mine = {k: v for k, v in files.items() if not k.startswith(f"{RANK_REPORTS}/")}  # a peer's report, in place
    body = json.dumps({"attempt": attempt, "files": mine}).encode()
    store.put_bytes(f"{checkpoint_dir(step)}/{RANK_REPORTS}/rank-{rank}.json", body, deadline)


def report_failure(store: Store, step: int, rank: int, attempt: str, err: BaseException,
                   deadline: float | None = None) -> None:
    """Say that this rank could not publish ``step``, so rank 0 stops waiting for it. Best
    effort: the store that failed the upload may refuse this too."""
    body = json.dumps({"attempt": attempt, "error": f"{type(err).__name__}: {err}"}).encode()
    try:
        store.put_bytes(f"{checkpoint_dir(step)}/{RANK_REPORTS}/rank-{rank}.json", body, deadline)
    except Exception as e:  # noqa: BLE001 - rank 0 then waits for this report until its deadline
        log.warning("could not report the failed publish of step-%d: %s", step, e)


def gather_reports(store: Store, step: int, attempt: str, world: int, deadline: float) -> dict[str, int]:
    """Rank 0: wait until every rank reported ``step`` in this attempt; all their files.

    Reports left by an earlier attempt at the same step do not count, so a checkpoint
    is never committed with shards from a run that died half-way. A rank that reports
    a failure ends the wait at once."""
    rel = f"{checkpoint_dir(step)}/{RANK_REPORTS}"
    while True:
        reports = []
        for name in store.list(rel):
            if not name.endswith(".json"):  # a report being written in place (its .tmp)
                continue
            body = json.loads(store.get_bytes(f"{rel}/{name}") or b"{}")
            if body.get("attempt") != attempt:
                continue
            if "error" in body:
                raise UploadError(f"{rel}: {name.removesuffix('.json')} could not publish its shards: {body['error']}")
            reports.append(body["files"])
        if len(reports) == world:
            return {path: size for files in reports for path, size in files.items()}
        if time.monotonic() > deadline:
            raise UploadError(f"{rel}: only {len(reports)} of {world} ranks published their shards in time")
        time.sleep(0.2)


def commit(store: Store, step: int, files: dict[str, int], deadline: float | None = None) -> None:
    """Rank 0: manifest, then the marker, then ``latest``: the marker is the commit."""
    rel = checkpoint_dir(step)
    store.put_bytes(f"{rel}/{MANIFEST}", json.dumps({"step": step, "files": files}, indent=1).encode(), deadline)
    store.put_bytes(f"{rel}/{COMMITTED}", f"{step}\n".encode(), deadline)
    store.put_bytes(f"{CHECKPOINTS}/{LATEST}", f"{step}\n".encode(), deadline)


def steps(store: Store) -> list[int]:
    """Every step with anything under checkpoints/, committed or not, newest first."""
    found = {step for name in store.list(CHECKPOINTS)
             if "/" in name and (step := parse_step_dir(name.split("/", 1)[0])) is not None}
    return sorted(found, reverse=True)


def verify(store: Store, step: int) -> str | None:
    """None when the checkpoint is complete, else why it is not."""
    objects = store.list(checkpoint_dir(step))
    if COMMITTED not in objects:
        return "no commit marker"
    try:
        files = json.loads(store.get_bytes(f"{checkpoint_dir(step)}/{MANIFEST}") or b"")["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest ({err})"
    for rel, size in files.items():
        if objects.get(rel) != size:
            return f"file {rel} missing or of the wrong size"
    return None


def find_resumable(store: Store) -> int | None:
    """The newest checkpoint that verifies, whatever ``latest`` says: ``latest`` is for
    people and tools, and an upload abandoned at a stop deadline could still move it
    back if its process lived on."""
    for step in steps(store):
        why = verify(store, step)
        if why is None:
            return step
        log.warning("ignoring checkpoint %s/%s: %s", store.uri, checkpoint_dir(step), why)
    return None


def prune(store: Store, newest: int, keep: int, pinned: int | None = None) -> list[int]:
    """Only after ``newest`` committed: drop committed ones beyond the newest ``keep``
    and the partial ones older than ``newest``. Newer ones (another save) are left.
    ``pinned`` (the best validated step, for export=best) is kept on top of ``keep``
    while it is committed."""
    older = [s for s in steps(store) if s < newest]
    committed = [s for s in older if verify(store, s) is None]
    kept = set(committed[: max(keep - 1, 0)]) | ({pinned} & set(committed))
    doomed = [s for s in older if s not in kept]
    for s in doomed:
        store.delete_dir(checkpoint_dir(s))
    return sorted(doomed)
