"""Three measurements behind bench/README.md's "Profile by op" (issue 30), side by side in one run.

1. Attention kernels: torch's CPU flash sdpa against the math path (one [s, s] product each
   way) and sftjob's own kernel (trainer.cpu_attention, where this CPU runs it), causal
   forward + backward of one sequence, at lengths 64...2000, and against a lower
   bound for any kernel on this CPU: its products (the causal half of QKᵀ and PV forward, and
   backward QKᵀ again, dV, dP, dQ, dK: 7·heads·s²·head_dim FLOPs) at this CPU's measured product
   rate (a 2048³ fp32 product) plus two exponentials per unmasked score (forward, and backward's
   recomputed softmax) at torch's measured exp rate; the softmax's other passes are left out.
2. A packed row's attention: one causal sdpa call per sample (what our trainer ran on CPU before
   its own kernel) against one batched call over the samples padded to the longest, and against
   sftjob's kernel (one call for the row), for many short samples and for the bench's lengths.
3. A micro-batch's fixed cost: a forward + backward of our trainer's model (the loss head,
   varlen attention) on a packed row of 8 tokens against rows of ~250-token samples; the
   8-token pass is almost all per-micro-batch work (every weight's gradient written in full).

    python -m bench.kernels [--work .bench] [--model DIR] [--cpu-mkl-dispatch instruction_set|vendor]
                            [--cpu-attention auto|sdpa]

Its products (the math path's, the flash kernel's blocks, the model's) run oneMKL's kernels as the
trainer picks them (`trainer.cpu_mkl_dispatch`, chosen before the first product).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import add_mkl_dispatch_option, pick_mkl_kernels

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, reps: int) -> float:
    """Milliseconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def attention(heads: int = 6, head_dim: int = 64) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    a, b, x = torch.randn(2048, 2048), torch.randn(2048, 2048), torch.randn(2048, 1024)
    gemm_gflops = 2 * 2048 ** 3 / min(timed(lambda: a @ b, 3) for _ in range(3)) / 1e6
    exp_ns = min(timed(lambda: torch.exp(x), 20) for _ in range(3)) * 1e6 / x.numel()
    print(f"bound's rates: products {gemm_gflops:.0f} GFLOP/s, exp {exp_ns:.2f} ns per element")
    from sftjob_trainer import cpu_attention

    ours = cpu_attention.chosen()
    print("| length | flash ms | math ms | math ÷ flash | flash GFLOP/s | bound ms | flash ÷ bound "
          "| sftjob ms | flash ÷ sftjob | sftjob GFLOP/s | sftjob ÷ bound |\n" + "|---" * 11 + "|")
    for s in (64, 128, 250, 500, 1000, 2000):
        q, k, v = (torch.randn(1, heads, s, head_dim, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        def sftjob(q=q, k=k, v=v, s=s):
            cpu_attention.packed_causal_attention(q, k, v, [0, s]).sum().backward()

        reps = max(3, int(2e6 / (s * s)))
        ms = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            with sdpa_kernel(backend):
                ms[name] = timed(step, reps)
        ms["sftjob"] = timed(sftjob, reps) if ours else float("nan")
        flops = 3 * 2 * heads * s * s * head_dim   # causal: half of QK^T and PV forward, 2x that backward
        bound = 7 * heads * s * s * head_dim / gemm_gflops / 1e6 + 2 * heads * s * s / 2 * exp_ns / 1e6
        print(f"| {s} | {ms['flash']:.2f} | {ms['math']:.2f} | {ms['math'] / ms['flash']:.2f} "
              f"| {flops / ms['flash'] / 1e6:.0f} | {bound:.2f} | {ms['flash'] / bound:.2f} | {ms['sftjob']:.2f} "
              f"| {ms['flash'] / ms['sftjob']:.2f} | {flops / ms['sftjob'] / 1e6:.0f} | {ms['sftjob'] / bound:.2f} |")


def packed_row_case(lens: list[int], cap: int, heads: int, kv_heads: int,
                    head_dim: int) -> tuple[float, float, float]:
    """(per-sample calls, one padded call, sftjob's kernel) in ms, forward + backward, for samples
    of ``lens`` tokens (the kernel's nan where it was not chosen)."""
    import torch
    import torch.nn.functional as F

    from sftjob_trainer import cpu_attention

    n = len(lens)
    q = torch.randn(1, heads, sum(lens), head_dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, sum(lens), head_dim, requires_grad=True) for _ in range(2))
    rows = torch.cat([torch.arange(i * cap, i * cap + m) for i, m in enumerate(lens)])

    def per_sample():
        parts = [F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                 for a, b, c in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))]
        torch.cat(parts, 2).sum().backward()

    def pad(x):
        return x.new_zeros(x.shape[1], n * cap, head_dim).index_copy(1, rows, x[0]) \
            .view(x.shape[1], n, cap, head_dim).transpose(0, 1)

    def padded():   # right-padded to cap: causal keeps every real query off the padding
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
        out.transpose(0, 1).reshape(heads, n * cap, head_dim).index_select(1, rows).sum().backward()

    def sftjob():
        cpu_attention.packed_causal_attention(q, k, v, [0, *torch.tensor(lens).cumsum(0).tolist()]).sum().backward()

    return timed(per_sample, 5), timed(padded, 5), timed(sftjob, 5) if cpu_attention.chosen() else float("nan")


def packed_row_attention(heads: int = 6, kv_heads: int = 2, head_dim: int = 64) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    print("| samples × max length | tokens | per-sample calls ms | one padded call ms | padded ÷ per-sample "
          "| sftjob's kernel ms | per-sample ÷ sftjob |\n|---|---|---|---|---|---|---|")
    bench_lens = torch.randint(84, 457, (8,), generator=g).tolist()   # the bench's lengths, 8 to a row
    for n, cap, lens in ((128, 64, None), (64, 128, None), (16, 512, None), (8, 456, bench_lens)):
        lens = lens or torch.randint(cap // 4, cap + 1, (n,), generator=g).tolist()
        a, b, c = packed_row_case(lens, cap, heads, kv_heads, head_dim)
        print(f"| {n} × {cap} | {sum(lens)} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c:.1f} | {a / c:.2f} |")


def micro_batch_cost(model_dir: Path) -> None:
    import torch

    from sftjob_contract.config import LoraConfig, ModelConfig
    from sftjob_trainer.batching import collate
    from sftjob_trainer.data import Sample
    from sftjob_trainer.dist import World
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model

    world = World(0, 0, 1, torch.device("cpu"))
    model = build_model(ModelConfig(path=str(model_dir)), LoraConfig(), str(model_dir), world, widen_bf16=False)
    model.train()
    for n, k in ((8, 1), (250, 1), (250, 2), (250, 4), (250, 8)):
        samples = [Sample(input_ids=list(range(5, 5 + n)), targets=list(range(6, 6 + n))) for _ in range(k)]
        mb = collate(samples, list(range(k)), True, 0)
        ms = timed(lambda mb=mb: ce_sum(model, mb, world.device, "fp32").backward(), 10)
        print(f"packed row of {k} x {n} tokens: forward + backward {ms:.1f} ms ({ms / (k * n) * 1e3:.0f} µs per token)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / ".bench", help="bench.sweep's WORK directory")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model our trainer loads (default: the one bench.sweep made for length 512 under WORK)")
    add_mkl_dispatch_option(ap)
    ap.add_argument("--cpu-attention", default="auto", choices=["auto", "sdpa"],
                    help="trainer.cpu_attention for the model's pass (sftjob's kernel is timed beside sdpa "
                    "wherever this CPU runs it)")
    args = ap.parse_args()
    pick_mkl_kernels(args.cpu_mkl_dispatch)
    from sftjob_trainer import cpu_attention
    print(cpu_attention.choose("auto"))
    model = args.model
    if model is None:
        from bench.sweep import made_inputs
        model = made_inputs(args.work, 512) / "model"
    attention()
    packed_row_attention()
    print(cpu_attention.choose(args.cpu_attention))
    micro_batch_cost(model)


if __name__ == "__main__":
    main()
