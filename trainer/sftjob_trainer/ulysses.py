"""Ulysses sequence parallelism (``trainer.sequence_parallel_size`` = sp > 1).

The ranks form a grid of dp = world/sp data-parallel groups of sp consecutive ranks
(rank = dp_rank·sp + sp_rank: an SP group sits on one node when sp divides the GPUs per
node, so its all-to-alls stay on the fast links). All ranks of an SP group read the same
samples (`dist.World.dp_rank`); `shard_micro_batch` pads each row to a multiple of sp and
keeps this rank's slice of it, with position ids and packed-sequence boundaries computed on
the full row first. Everything outside attention is per token, so it runs on the slice
unchanged; around attention, `ulysses_attention` swaps the slice for all heads for the full
row for heads/sp (one all-to-all each for q, k, v), runs the chosen kernel on whole
sequences, and swaps back.

The loss needs nothing special: each rank sums the CE of the targets in its slice and
counts only those targets, so the all-reduced sums and counts are those of the non-SP run.
FSDP2 still shards over the whole world (model.shard_model): every rank's gradient is a
partial sum (its tokens' share, the all-to-all's backward bringing in the other ranks'
attention gradients), so the world-wide reduce-scatter is exactly the sum we need, and the
parameters and optimizer state are split world-ways, as small as they get. The checkpoint
layout is therefore the one of a non-SP run of the same world size, and a checkpoint resumes
at any sp (the global sample order does not depend on how it is split).

A model whose key/value heads are fewer than sp gets each kv head repeated sp/kv times
before the exchange (so every rank has the kv head its query heads use); heads that divide
neither way are refused.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import torch.distributed as dist

from .batching import MicroBatch
from .data import IGNORE
from .dist import World
from .errors import InvalidConfig

FIELD = "trainer.sequence_parallel_size"
PREFIX = "ulysses_"
# This process's SP group (one per process: set by `setup`, read by the attention wrapper).
_GROUP: dist.ProcessGroup | None = None


# --------------------------------------------------------------------------- grid


def setup(world: World, sp: int) -> World:
    """The world with its SP size, after making the SP process groups (collective: every rank)."""
    global _GROUP
    if sp == 1:
        return world
    if world.size % sp:
        raise InvalidConfig(f"{FIELD}={sp} must divide the number of processes ({world.size}); "
                            f"use a divisor of it, or 1 to turn sequence parallelism off")
    for first in range(0, world.size, sp):  # new_group is collective: every rank makes every group
        group = dist.new_group(list(range(first, first + sp)))
        if first <= world.rank < first + sp:
            _GROUP = group
    return replace(world, sp=sp)


def check_heads(config, sp: int) -> None:
    """Refuse a model whose attention heads cannot be spread over sp ranks."""
    if sp == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    if not heads or heads % sp:
        raise InvalidConfig(f"{FIELD}={sp} must divide the model's num_attention_heads ({heads})")
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv % sp and sp % kv:
        raise InvalidConfig(f"{FIELD}={sp} and the model's num_key_value_heads ({kv}) must divide one another "
                            f"(kv heads are split over the ranks, or repeated when fewer than {FIELD})")


# --------------------------------------------------------------------------- data


def shard_micro_batch(mb: MicroBatch, sp_rank: int, sp: int, pad_id: int) -> MicroBatch:
    """This rank's slice of every row of ``mb`` (padded to a multiple of sp with ignored targets).

    A packed row's boundaries (``cu_seq_lens``, the padding as a sequence of its own) and
    the position ids come from the full row. Padded (unpacked) rows drop their attention
    mask: their padding is at the end, so causal attention never lets a real token see it.
    Sample ids and sequence lengths stay on sp_rank 0 only, so metrics gathered over all
    ranks count each sample once."""
    rows, width = mb.input_ids.shape
    extra = -width % sp
    real = mb.attention_mask.bool() if mb.attention_mask is not None else torch.ones(rows, width, dtype=torch.bool)
    pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)  # noqa: E731 - a one-line helper
    ids, targets, real = pad(mb.input_ids, pad_id), pad(mb.targets, IGNORE), pad(real, False)
    if mb.attention_mask is None:  # packed: positions restart per sequence; the padding is one more
        lengths = list(mb.seq_lengths) + ([extra] if extra else [])
        positions = torch.cat([mb.position_ids, torch.arange(extra).unsqueeze(0)], dim=1)
    else:
        lengths = [width + extra]
        positions = torch.arange(width + extra).unsqueeze(0).expand(rows, -1).contiguous()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32) if rows == 1 else None
    size = (width + extra) // sp
    mine = slice(sp_rank * size, (sp_rank + 1) * size)
    return replace(mb, input_ids=ids[:, mine], targets=targets[:, mine], position_ids=positions[:, mine],
                   attention_mask=None, n_tokens=int(real[:, mine].sum()),
                   n_targets=int((targets[:, mine] != IGNORE).sum()),
                   sample_ids=list(mb.sample_ids) if sp_rank == 0 else [],
                   seq_lengths=list(mb.seq_lengths) if sp_rank == 0 else [], cu_seq_lens=cu)


def sharder(world: World, pad_id: int):
    """``shard_micro_batch`` for this rank, or None without sequence parallelism."""
    if world.sp == 1:
        return None
    return lambda mb: shard_micro_batch(mb, world.sp_rank, world.sp, pad_id)


# --------------------------------------------------------------------------- all-to-all


class _AllToAll(torch.autograd.Function):
    """Exchange the equal dim-0 chunks of ``x`` within the group (chunk j goes to rank j).

    The exchange is its own inverse, so the backward pass is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    # Both buffers contiguous: all_to_all_single reads and writes them as flat memory, and
    # empty_like of a strided tensor (a gradient often is one) would keep its strides.
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[batch, heads, seq/sp, dim] (this rank's slice) → [batch, heads/sp, seq, dim] (full rows)."""
    sp = group.size()
    b, h, s, d = x.shape
    chunks = x.reshape(b, sp, h // sp, s, d).transpose(0, 1)  # chunk j: head group j, for rank j
    got = _AllToAll.apply(chunks.contiguous(), group)  # chunk j: rank j's slice of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[batch, seq, heads/sp, dim] (attention output, full rows) → [batch, seq/sp, heads, dim]."""
    sp = group.size()
    b, s, h, d = x.shape
    chunks = x.reshape(b, sp, s // sp, h, d).transpose(0, 1)  # chunk j: slice j, for rank j
    got = _AllToAll.apply(chunks.contiguous(), group)  # chunk j: head group j of my slice
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // sp, sp * h, d)


# --------------------------------------------------------------------------- attention


class _LocalHeads:
    """The attention module as the kernels see it after the exchange: its query heads per kv
    head counted on this rank's heads (they differ when kv heads were repeated)."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _eager(module, query, key, value, dropout=0.0, scaling=None, cu=None):
    """Plain softmax attention, causal within each sequence of the row (bounds ``cu``)."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    n = query.shape[2]
    idx = torch.arange(n, device=query.device)
    allowed = idx[None, :] <= idx[:, None]
    if cu is not None:
        seq = torch.bucketize(idx, cu[1:].to(query.device), right=True)
        allowed &= seq[:, None] == seq[None, :]
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


@torch.compiler.disable
def ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, inner: str, **kwargs):
    """Attention of this rank's row slices via an all-to-all over heads (module docstring).

    The inputs are [batch, heads, seq/sp, dim]; the result [batch, seq/sp, heads, dim]. The
    shard's position ids are dropped: sequence boundaries come from the full row's
    ``cu_seq_lens_q`` (one-row batches), and several padded rows are plain causal."""
    from transformers import AttentionInterface

    group = _GROUP
    assert group is not None  # registered only with sp > 1, after setup() made the SP groups
    sp = group.size()
    if attention_mask is not None:
        raise RuntimeError("sequence-parallel attention takes no mask (rows are split with cu_seq_lens)")
    if key.shape[1] % sp:  # fewer kv heads than ranks: repeat each so every rank has its own copy
        key = key.repeat_interleave(sp // key.shape[1], dim=1)
        value = value.repeat_interleave(sp // value.shape[1], dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("position_ids", None)
    local = _LocalHeads(module, q.shape[1] // k.shape[1])
    if inner == "eager":
        out, _ = _eager(local, q, k, v, dropout, scaling, kwargs.get("cu_seq_lens_q"))
    else:
        # Plain "sdpa" runs as sdpa_varlen: the same causal sdpa per sequence, without a mask.
        fn = AttentionInterface()["sdpa_varlen" if inner == "sdpa" else inner]
        out, _ = fn(local, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)
    return heads_to_seq(out, group), None


def register(inner: str) -> str:
    """Register the Ulysses wrapper around ``inner`` with transformers; returns its name.

    The name has no mask function registered, so transformers builds no mask for it."""
    import functools

    from transformers import AttentionInterface

    name = PREFIX + inner
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=inner))
    return name
