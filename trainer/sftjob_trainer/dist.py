"""Process-group set-up and the few collectives the trainer needs.

A single process (no torchrun) runs without a process group; every helper here then
degrades to the local value, so the same code path serves 1 and N processes.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sftjob_contract import env as E


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int
    device: torch.device
    # Ranks per sequence-parallel group (trainer.sequence_parallel_size; ulysses.setup sets it).
    sp: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of the global batch this rank reads: the ranks of an SP group read the same."""
        return self.rank // self.sp

    @property
    def dp_size(self) -> int:
        return self.size // self.sp

    @property
    def sp_rank(self) -> int:
        """This rank's slice of each row within its SP group."""
        return self.rank % self.sp


def init_world(timeout_s: float = 1800.0) -> World:
    """Join the torchrun process group when launched by torchrun, else run alone."""
    size = int(os.environ.get(E.WORLD_SIZE, "1"))
    rank = int(os.environ.get(E.RANK, "0"))
    local_rank = int(os.environ.get(E.LOCAL_RANK, "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return World(rank=rank, local_rank=local_rank, size=size, device=device)


def backend_for(device: torch.device) -> str:
    """NCCL for the model's CUDA tensors, and gloo beside it for the small CPU tensors and
    objects the trainer reduces (step counts, losses, the stop flag); NCCL alone would
    refuse every CPU tensor. On CPU everything goes through gloo."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over all ranks (a copy; the input is left alone)."""
    out = values.clone()
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    out = values.clone()
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
