"""Attention: which kernel a run uses, and ``sdpa_varlen``, our per-sequence sdpa for packed rows.

A packed row (several sequences, positions restarting) runs causal sdpa once per sequence
instead of one dense block-diagonal mask over the whole row, so no attention FLOPs are
spent on blocks that are masked out anyway.

`pick_attention` is the one place that decides the kernel, and it never picks one that
cannot run: flash-attention only takes bf16/fp16 inputs on CUDA, so ``auto`` picks it only
for a bf16 run on a GPU with flash-attn installed; everything else (fp32, CPU, no flash-attn)
gets ``sdpa_varlen``. An explicit ``flash_attention_2`` with fp32 is refused when the config
is validated (sftjob_contract.config), an explicit one without CUDA or flash-attn when the model is built.

On a CPU, ``sdpa_varlen`` runs sftjob's own kernel for the whole row instead of torch's sdpa per
sequence where ``trainer.cpu_attention`` chose it and it applies (cpu_attention.py).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from . import cpu_attention
from .errors import InvalidConfig
from .precision import bf16_autocast_on, widened_sdpa

VARLEN = "sdpa_varlen"
FLASH = "flash_attention_2"
# Compute precisions flash-attention accepts (trainer.precision offers fp32 and bf16).
FLASH_PRECISIONS = ("bf16", "fp16")


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def pick_attention(requested: str, device: torch.device, precision: str) -> str:
    """The attention implementation for ``model.attn_implementation=requested`` (see module docstring)."""
    if requested == FLASH:
        if device.type != "cuda" or not flash_attn_installed():
            raise InvalidConfig(f"model.attn_implementation={FLASH} needs a CUDA device and the flash-attn "
                                f"package (device {device.type}, flash-attn "
                                f"{'installed' if flash_attn_installed() else 'not installed'})")
        return FLASH
    if requested != "auto":
        return requested
    if device.type == "cuda" and precision in FLASH_PRECISIONS and flash_attn_installed():
        return FLASH
    return VARLEN


def sequence_bounds(kwargs: dict) -> list[int]:
    """Start offsets of the sequences in a packed row, plus its length at the end."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return [int(x) for x in cu.tolist()]
    pos = kwargs.get("position_ids")
    if pos is None:
        raise RuntimeError(f"{VARLEN} attention needs position_ids or cu_seq_lens_q to find sequence boundaries")
    row = pos.reshape(-1)
    starts = (row == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [row.numel()]


# Left out of torch.compile'd decoder layers (trainer.compile): the split sizes are data, so
# a traced version would recompile for every new set of sequence lengths.
@torch.compiler.disable
def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal sdpa per sequence of a packed row; anything else goes to stock sdpa.

    query/key/value are [1, heads, tokens, head_dim]; the result is [1, tokens, heads, head_dim]
    like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = sequence_bounds(kwargs)
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if cpu_attention.applies(query, key, value, dropout, scaling):
        return cpu_attention.packed_causal_attention(query, key, value, sorted(set(bounds)), scaling), None
    gqa = query.shape[1] != key.shape[1]
    widen = getattr(module, "widen_bf16", False) and bf16_autocast_on(query.device)
    sdpa = widened_sdpa if widen else F.scaled_dot_product_attention
    # split, not slicing: the backward of a split is one cat, while every slice's backward
    # would zero-fill and add a full-size gradient (a cost growing with sequences per row).
    parts = [
        sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def varlen_sdpa_mask(*args, attention_mask=None, **kwargs):
    """No mask for unpadded rows (the attention splits them by sequence); stock sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN, varlen_sdpa_mask)
