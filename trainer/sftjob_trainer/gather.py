"""How often FSDP2 gathers the model's weights and reduces its gradients (``trainer.fsdp_gather``).

FSDP2 (model.shard_model) keeps each rank's shard of every decoder layer. By default
(``per_layer``) a layer's weights are all-gathered for its forward, freed, all-gathered again
for its backward and freed, and its gradients are reduce-scattered after every micro-batch:
with k micro-batches a step all-gathers the model 2k times and reduce-scatters it k times,
holding one layer's full weights at a time.

``per_step`` keeps every layer's gathered weights, and its full gradients, from the step's
first forward to its last backward: one all-gather and one reduce-scatter of the model per
step (gradients accumulate locally between micro-batches, in fp32 under bf16 as FSDP2's
reduction does). The price is the whole model's weights (compute dtype) and trainable
gradients (fp32) on every rank for the step's duration; the optimizer still updates shards,
so its state stays sharded and the step's arithmetic is the same up to summation order.

``auto`` picks ``per_step`` when that extra memory is at most ``AUTO_SHARE`` of what one rank
may use (the accelerator's memory; on a CPU the pod's memory limit, or the host's without
one, shared by the node's ranks), else ``per_layer``; one process and CPU offload stay
``per_layer`` (nothing to gather / the point of offload is not to hold the model). Measured
on the bench model at 2 ranks on a 2-core CPU: 1.09x tokens/s (1.04-1.12x per repetition; bench/README.md).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch
from torch import nn

from sftjob_contract import env as E
from sftjob_contract.config import TrainerConfig

from .dist import World

log = logging.getLogger(__name__)
AUTO_SHARE = 0.1
T = TypeVar("T")


def extra_bytes(model: nn.Module, precision: str) -> int:
    """Bytes ``per_step`` holds beyond ``per_layer``: every parameter gathered in the compute dtype,
    and an fp32 gradient for every trainable one (a DTensor's numel is the full tensor's)."""
    weight = 2 if precision == "bf16" else 4
    return sum(p.numel() * (weight + (4 if p.requires_grad else 0)) for p in model.parameters())


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    for f in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes ~2^63 for "no limit"
            return int(text)
    return None


def rank_memory_bytes(device: torch.device, local_ranks: int) -> int:
    """What one rank may use: its accelerator's memory, or its share of the host's (pod's) memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return (min(host, limit) if limit else host) // max(1, local_ranks)


def choose(setting: str, extra: int, memory: int, sharded: bool, offload: bool) -> tuple[bool, str]:
    """(gather once per step?, why) for ``trainer.fsdp_gather`` = ``setting``."""
    if not sharded:
        return False, "one process: the model is not sharded"
    size = f"{extra / 2**20:,.0f} MiB"
    if setting == "per_step":
        return True, f"per step (trainer.fsdp_gather=per_step; holds {size} more per rank)"
    if setting == "per_layer":
        return False, "per layer and micro-batch (trainer.fsdp_gather=per_layer)"
    if offload:
        return False, "per layer and micro-batch (auto: trainer.cpu_offload keeps the model off the accelerator)"
    budget = f"{AUTO_SHARE:.0%} of {memory / 2**20:,.0f} MiB per rank"
    if extra <= AUTO_SHARE * memory:
        return True, f"per step (auto: the gathered model and its gradients, {size}, fit in {budget})"
    return False, f"per layer and micro-batch (auto: the gathered model and its gradients, {size}, exceed {budget})"


def micro_batches(model: nn.Module, per_step: bool, batches: Sequence[T]) -> Iterator[T]:
    """The step's micro-batches, with FSDP2 told before each what to keep when ``per_step``:
    layers stay gathered after their forward; gradients are neither reduced nor the weights freed
    until the last micro-batch's backward, after which everything is sharded again."""
    if not per_step:
        yield from batches
        return
    from torch.distributed.fsdp import FSDPModule

    from .model import decoder_layers

    root = cast(FSDPModule, model)
    fsdp_layers = [layer for layer in decoder_layers(model) if isinstance(layer, FSDPModule)]
    for layer in fsdp_layers:
        layer.set_reshard_after_forward(False)
    try:
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            root.set_requires_gradient_sync(last)
            root.set_reshard_after_backward(last)
            yield mb
    finally:
        for layer in fsdp_layers:
            layer.set_reshard_after_forward(True)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)


@dataclass(frozen=True)
class Plan:
    model: nn.Module
    per_step: bool

    def micro_batches(self, batches: Sequence[T]) -> Iterator[T]:
        return micro_batches(self.model, self.per_step, batches)


def plan(model: nn.Module, trainer: TrainerConfig, world: World) -> Plan:
    """The trainer's choice for a built (sharded or not) model; rank 0 logs it."""
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, FSDPModule) and world.size > 1
    extra = extra_bytes(model, trainer.precision) if sharded else 0
    memory = rank_memory_bytes(world.device, int(os.environ.get(E.LOCAL_WORLD_SIZE, "1"))) if sharded else 0
    per_step, why = choose(trainer.fsdp_gather, extra, memory, sharded, trainer.cpu_offload)
    if world.is_main and sharded:
        log.info("FSDP gathers the weights %s", why)
    return Plan(model, per_step)
