"""AdamW and the learning-rate schedules (cosine, warmup-stable-decay, constant).

The schedule is a pure function of the step, so a resumed run needs only the step
number to continue it exactly.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from sftjob_contract.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig, fused: bool) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if fused:
        # The fused kernel is the fastest on one device; DTensor parameters take foreach.
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step creates it (step 0, zero moments), for a resume to
    load the checkpoint's state into. Without it, torch's state-dict helper creates the
    state by running a whole optimizer step on zero gradients: 7 s for a 0.37B model's
    two CPU ranks, on the restart gap's critical path. Mirrors ``torch.optim.Adam``'s
    lazy initialisation; amsgrad (which this trainer never sets) is left to torch."""
    if not isinstance(optimizer, torch.optim.Adam) or any(g.get("amsgrad") for g in optimizer.param_groups):
        return
    try:
        from torch.optim.optimizer import _get_scalar_dtype   # private: a torch without it gets torch's way
    except ImportError:
        return

    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
                             if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def lr_factor(cfg: OptimConfig, step: int, total: int) -> float:
    """Multiplier of cfg.lr for the optimizer step numbered ``step`` (0-based)."""
    warmup = int(cfg.lr_warmup_steps_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    floor = cfg.min_lr_ratio
    if cfg.lr_scheduler == "constant":
        return 1.0
    if cfg.lr_scheduler == "cosine":
        span = max(total - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly over the last wsd_decay_ratio of the run.
    decay = max(int(cfg.wsd_decay_ratio * total), 1)
    start = total - decay
    if step < start:
        return 1.0
    progress = min((step - start + 1) / decay, 1.0)
    return floor + (1 - floor) * (1 - progress)


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total: int) -> float:
    lr = cfg.lr * lr_factor(cfg, step, total)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
