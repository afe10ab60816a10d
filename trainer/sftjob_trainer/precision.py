"""Compute precision: every choice ``trainer.precision`` implies is made in this file.

``trainer.precision=bf16`` means, on every device:
- FSDP2 (several processes) runs with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` (`fsdp_mixed_precision`): the sharded master parameters and the
  optimizer state are fp32, each layer's all-gather casts its shard to bf16 first (half the
  traffic and unsharded memory of fp32; LoRA's frozen base weights too), and gradients are
  reduce-scattered in fp32 into fp32 gradient shards. One process keeps fp32 weights.
- bf16 autocast stays on around the forward: with bf16 parameters it is what keeps the
  ops autocast lists as fp32 in fp32, and it marks the products that run *widened* below.
  Matmul operands are rounded to bf16, products are accumulated in fp32 and rounded to bf16.

GPUs and CPUs with AVX512-BF16 or AMX run those products natively. Other x86 CPUs
(AVX-512 without BF16, AVX2) have no bf16 dot product: oneDNN emulates one, several times
slower than its fp32 GEMM. There the trainer can run each bf16 product *widened*: the bf16
operands are converted to fp32 (exactly, bf16 is a prefix of fp32), multiplied by the fp32
GEMM, and the result rounded to bf16. That is the same arithmetic a bf16 GEMM with fp32
accumulation does, up to summation order, at fp32 GEMM speed. Linear layers save their
bf16 inputs for the backward pass; attention saves fp32 copies, one sequence at a time.
``trainer.cpu_bf16_gemm`` chooses (`use_widened_bf16`): ``auto`` (widened exactly when the
CPU lacks native bf16), ``native`` or ``widened``. The widened path needs nothing from FSDP:
it widens bf16 operands, whether autocast or the gather made them bf16.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_blas import read_cpu

log = logging.getLogger(__name__)

BF16 = torch.bfloat16


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: the CPU has bf16 dot-product instructions."""
    cpu = read_cpu()
    if not cpu.known:
        return True  # unknown (not Linux): keep oneDNN's native path
    return bool({"avx512_bf16", "amx_bf16"} & cpu.flags)


def use_widened_bf16(device: torch.device, precision: str, cpu_bf16_gemm: str) -> bool:
    """Whether this run's bf16 matrix products run widened to fp32 (see the module docstring)."""
    if precision != "bf16" or device.type != "cpu":
        return False
    native = cpu_has_native_bf16()
    if cpu_bf16_gemm == "native" and not native:
        log.warning("trainer.precision=bf16 with cpu_bf16_gemm=native on a CPU without native bf16: "
                    "oneDNN emulates bf16 and runs several times slower than fp32")
    if cpu_bf16_gemm == "auto" and not native:
        log.info("bf16 matrix products run widened to fp32 GEMMs: this CPU has no AVX512-BF16/AMX "
                 "(same arithmetic as a bf16 GEMM; trainer.cpu_bf16_gemm=native to use oneDNN's emulation)")
    return cpu_bf16_gemm == "widened" or (cpu_bf16_gemm == "auto" and not native)


def fsdp_mixed_precision(precision: str):
    """FSDP2's policy for ``trainer.precision`` (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def autocast_for(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=BF16)
    return contextlib.nullcontext()


def bf16_autocast_on(device: torch.device) -> bool:
    return torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == BF16


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices (or bf16 values already widened to fp32): an fp32 GEMM of the
    widened operands, rounded to bf16."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return torch.mm(a.float(), b.float()).to(BF16)


class _WidenedLinear(torch.autograd.Function):
    """y = x·wᵀ + b on bf16 tensors with every GEMM (forward, both gradients) widened to fp32.

    Saves the bf16 inputs, not fp32 copies, so activation memory is what native bf16 uses.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(BF16)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g = grad_y.reshape(-1, grad_y.shape[-1])
        gx = gemm(g, weight).reshape(x.shape) if need_x else None
        gw = gemm(g.t(), x.reshape(-1, x.shape[-1])) if need_w else None
        gb = g.float().sum(0).to(BF16) if need_b and ctx.has_bias else None
        return gx, gw, gb


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear that widens its GEMMs while bf16 autocast is on, and is plain F.linear otherwise."""
    if not bf16_autocast_on(x.device):
        return F.linear(x, weight, bias)
    return _WidenedLinear.apply(x.to(BF16), weight.to(BF16), None if bias is None else bias.to(BF16))


class WidenedBf16Linear(nn.Linear):
    """An nn.Linear whose bf16 autocast GEMMs run widened (same parameters and state-dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return widened_linear(x, self.weight, self.bias)


def widened_sdpa(query, key, value, **kwargs) -> torch.Tensor:
    """Scaled dot-product attention as bf16 autocast computes it (q, k, v rounded to bf16, the
    output rounded to bf16), with the products in fp32.

    CPU flash attention accumulates bf16 in fp32 anyway; the widened call only avoids the
    emulated bf16 products. Used per sequence, so the fp32 copies it saves are small.
    """
    q, k, v = (t.to(BF16).float() for t in (query, key, value))
    with torch.autocast(device_type=query.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out.to(BF16)
