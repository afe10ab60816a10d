"""Run under torchrun (gloo, sp ranks): one packed row through the tiny model, whole on every
rank and sliced with Ulysses, for each attention kernel; prints the largest relative
difference of the summed loss and of the all-reduced gradients, as JSON, on rank 0.

    torchrun --nproc-per-node=2 tests/trainer/ulysses_worker.py MODEL_DIR
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from sftjob_trainer import ulysses
from sftjob_trainer.attention import VARLEN, register_attention
from sftjob_trainer.batching import MicroBatch
from sftjob_trainer.dist import World
from sftjob_trainer.loss import ce_sum, install_loss_head

CPU = torch.device("cpu")


def model(path: str, attn: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    install_loss_head(m)
    return m


def packed_row(vocab: int) -> MicroBatch:
    """Three sequences (17 tokens: not a multiple of 2 or 4, so the slices need padding)."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 7, 5]
    ids = torch.randint(5, vocab, (1, sum(lengths)), generator=g)
    targets = torch.randint(5, vocab, (1, sum(lengths)), generator=g)
    targets[0, :3] = -100  # a prompt
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    return MicroBatch(ids, targets, positions, None, [0], sum(lengths), int((targets != -100).sum()), lengths)


def compare(path: str, inner: str, world: World) -> dict:
    mb = packed_row(model(path, "eager").config.vocab_size - 1)
    whole = model(path, inner)
    ce = ce_sum(whole, mb, CPU, "fp32")
    ce.backward()
    sliced = model(path, ulysses.register(inner))
    part = ce_sum(sliced, ulysses.shard_micro_batch(mb, world.sp_rank, world.sp, 0), CPU, "fp32")
    part.backward()
    total = part.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (_, p), (_, q) in zip(whole.named_parameters(), sliced.named_parameters()):
        grad = q.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - p.grad).norm() / p.grad.norm()).item())
    return {"loss": abs(total.item() - ce.item()) / abs(ce.item()), "grad": worst}


def main() -> None:
    path = sys.argv[1]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    world = ulysses.setup(World(rank, rank, size, CPU), size)
    register_attention()
    out = {inner: compare(path, inner, world) for inner in (VARLEN, "sdpa", "eager")}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
