"""Token-level cross-entropy on the trained positions only.

The LM head runs only on positions that have a target (``logits_to_keep``), so prompt
tokens never cost a vocabulary-sized matmul, and the loss is a *sum* so the caller can
normalise by the target tokens of the whole global batch.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .data import IGNORE, MicroBatch


def autocast_for(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def ce_sum(model, mb: MicroBatch, device: torch.device, precision: str) -> torch.Tensor:
    """Sum of the cross-entropy over every target token of the micro-batch."""
    targets = mb.targets.to(device)
    keep = (targets != IGNORE).any(dim=0).nonzero().squeeze(1)
    with autocast_for(device, precision):
        out = model(
            input_ids=mb.input_ids.to(device),
            position_ids=mb.position_ids.to(device),
            attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(device),
            logits_to_keep=keep,
            use_cache=False,
        )
    logits = out.logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets[:, keep].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
