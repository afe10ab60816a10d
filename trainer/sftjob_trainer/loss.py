"""Token-level cross-entropy on the trained positions only, never over whole-batch logits.

The LM head runs only on positions that have a target (``logits_to_keep``), so prompt
tokens never cost a vocabulary-sized matmul, and the loss is a *sum* so the caller can
normalise by the target tokens of the whole global batch.

When the model's head is a `LossHead` (below; `model.build_model` installs it) the head
itself computes the loss in chunks of target tokens: per chunk the logits are formed,
reduced to their log-sum-exp, turned into the gradient of the CE (softmax minus one-hot)
and multiplied back into the gradients of the hidden states and of the head weight, then
dropped. The
backward pass only scales those saved gradients, so no ``[tokens, vocab]`` tensor
outlives its chunk and the head's matmuls are not recomputed. Otherwise (e.g. a LoRA
adapter on the head) the logits come from the model and the fp32 CE is taken in chunks.

Packed rows carry ``cu_seq_lens`` so that flash-attention varlen (GPU) and our
``sdpa_varlen`` attention (CPU) find the sequence boundaries without a mask.
"""
from __future__ import annotations

import contextlib
import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .data import IGNORE
from .batching import MicroBatch
from .precision import autocast_for, gemm, widened_linear
from .unwrap import output_head

log = logging.getLogger(__name__)

# Elements of one fp32 logits chunk (32 MiB): big enough for efficient matmuls, small next
# to the activations of a micro-batch.
CHUNK_ELEMENTS = 1 << 23


def chunk_rows(vocab: int) -> int:
    return max(64, CHUNK_ELEMENTS // max(vocab, 1))


def _chunked(hidden, weight, targets, dtype, need_h: bool, need_w: bool, widen: bool = False):
    """(CE sum, d/d hidden, d/d weight) of the rows of ``hidden``, one chunk of logits at a time.

    ``widen``: bf16 products run as widened fp32 GEMMs (precision.py); the head's weight is
    rounded to bf16 and widened once, not per chunk."""
    widen = widen and dtype == torch.bfloat16
    mm = gemm if widen else torch.mm
    n, vocab = hidden.shape[0], weight.shape[0]
    w = weight.to(dtype).float() if widen else weight.to(dtype)
    grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
    # The head's gradient is written by the first chunk's product and added to by the next:
    # no zero-filled vocab x hidden buffer per micro-batch.
    grad_w = None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    step = chunk_rows(vocab)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        for a in range(0, n, step):
            h = hidden[a : a + step].to(dtype)
            t = targets[a : a + step]
            logits = mm(h, w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if not (need_h or need_w):
                continue
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, reusing the logits buffer
            probs[torch.arange(t.numel(), device=t.device), t] -= 1.0
            g = probs.to(dtype)
            # grad_h / grad_w exist exactly when need_h / need_w
            if grad_h is not None and widen:
                grad_h[a : a + step] = gemm(g, w)
            elif grad_h is not None:
                torch.mm(g, w, out=grad_h[a : a + step])
            if not need_w:
                continue
            if grad_w is None:
                grad_w = mm(g.t(), h).float()
            elif dtype == torch.float32:
                grad_w.addmm_(g.t(), h)
            else:
                grad_w += mm(g.t(), h).float()
    if need_w and grad_w is None:  # no rows with a target
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return total, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i · weightᵀ, target_i); its gradients are formed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype, widen):
        need_h, need_w = ctx.needs_input_grad[:2]
        total, grad_h, grad_w = _chunked(hidden, weight, targets, dtype, need_h, need_w, widen)
        # Kept on ctx, not saved for backward: they are this function's own buffers, which
        # backward scales in place and hands on (autograd then keeps the first micro-batch's
        # as .grad instead of copying it), so no second vocab x hidden tensor per micro-batch.
        ctx.grads = grad_h, grad_w
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("the loss head's backward ran twice (retain_graph): its gradients were formed in "
                               "forward and have already been handed on")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        gh = None if grad_h is None else grad_h.mul_(grad_out).to(ctx.dtypes[0])
        gw = None if grad_w is None else grad_w.mul_(grad_out).to(ctx.dtypes[1])
        return gh, gw, None, None, None


def linear_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  widen: bool = False) -> torch.Tensor:
    """Summed CE of ``hidden @ weightᵀ`` against ``targets`` (IGNORE entries skipped), chunked.

    Matmuls run in the autocast dtype when autocast is on (widened to fp32 GEMMs if
    ``widen``), the softmax/log-sum-exp in fp32.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    valid = targets != IGNORE
    if not bool(valid.all()):
        hidden, targets = hidden[valid], targets[valid]
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        return _chunked(hidden, weight, targets, dtype, False, False, widen)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets, dtype, widen)


def chunked_ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 CE over materialised logits, cast to fp32 one chunk of rows at a time."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    step = chunk_rows(logits.shape[-1])
    # Started from a tensor zero (not sum's int 0) so that the result is a tensor even without rows.
    return sum(
        (F.cross_entropy(logits[a : a + step].float(), targets[a : a + step], ignore_index=IGNORE, reduction="sum")
         for a in range(0, logits.shape[0], step)),
        logits.new_zeros((), dtype=torch.float32),
    )


# --------------------------------------------------------------------------- loss head


class LossHead(nn.Linear):
    """An LM head that returns the summed CE of ``targets`` while `computing_loss` is active.

    Outside that context it is the plain linear layer it replaced (same parameters and
    state-dict keys), so export, generation and checkpoints do not see a difference.
    """

    targets: torch.Tensor | None = None
    widen_bf16: bool = False

    @contextlib.contextmanager
    def computing_loss(self, targets: torch.Tensor):
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return widened_linear(hidden, self.weight, self.bias) if self.widen_bf16 else super().forward(hidden)
        return linear_ce_sum(hidden, self.weight, self.targets, self.widen_bf16)


def install_loss_head(model: nn.Module) -> bool:
    """Turn a bias-free nn.Linear LM head into a `LossHead` in place; False if the head is something else."""
    head = output_head(model)
    if type(head) is not nn.Linear or head.bias is not None:
        log.info("LM head %s is not a plain linear layer: the loss is taken on materialised logits",
                 type(head).__name__)
        return False
    head.__class__ = LossHead
    return True


def loss_head(model: nn.Module) -> LossHead | None:
    head = output_head(model)
    return head if isinstance(head, LossHead) else None



def varlen_kwargs(mb: MicroBatch, device: torch.device) -> dict:
    """Sequence boundaries of a packed row, in the form transformers' varlen attention reads."""
    if mb.cu_seq_lens is not None:  # a sequence-parallel slice: the full row's boundaries (ulysses.py)
        cu = mb.cu_seq_lens.to(device)
        longest = int((cu[1:] - cu[:-1]).max())
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if mb.attention_mask is not None or mb.input_ids.shape[0] != 1:
        return {}
    cu = torch.tensor([0, *itertools.accumulate(mb.seq_lengths)], dtype=torch.int32, device=device)
    longest = max(mb.seq_lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def ce_sum(model, mb: MicroBatch, device: torch.device, precision: str) -> torch.Tensor:
    """Sum of the cross-entropy over every target token of the micro-batch."""
    targets = mb.targets.to(device)
    keep = (targets != IGNORE).any(dim=0).nonzero().squeeze(1)
    kept = targets[:, keep]
    head = loss_head(model)
    scope = head.computing_loss(kept) if head is not None else contextlib.nullcontext()
    with autocast_for(device, precision), scope:
        out = model(
            input_ids=mb.input_ids.to(device),
            position_ids=mb.position_ids.to(device),
            attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(device),
            logits_to_keep=keep,
            use_cache=False,
            **varlen_kwargs(mb, device),
        )
    if head is not None:
        return out.logits  # the head returned the CE sum itself
    return chunked_ce_sum(out.logits, kept)
