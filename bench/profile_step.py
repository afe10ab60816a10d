#!/usr/bin/env python
"""Where our trainer's step time goes on the CPU bench: torch.profiler over a few steps.

Runs the trainer's own pieces (model build with varlen attention and loss head, the global
batch schedule, ce_sum, clip, fused AdamW) on the bench data and model made by bench/run.py,
profiles --steps optimizer steps after one warm-up step and prints the top operators by self
CPU time plus a coarse breakdown (matmuls, attention, loss head, optimizer, the rest).

Usage: python -m bench.profile_step [--precision fp32|bf16] [--cpu-bf16-gemm auto|native|widened]
                                    [--steps 2] [--work .bench] [--point NAME [--no-packing]]
                                    [--compile none|layers|mlp-norms] [--timed N] [--by-shape N]
                                    [--cpu-attention auto|sdpa]

It ends with the GEMMs' own rate and the bound they set: the tokens/s of a step in which
every other operator took no time.

``--by-shape N`` adds the top N rows by operator *and input shape* (sizes that are token counts
printed as T), with each product's GFLOP/s. Like the trainer, it runs on tcmalloc when the
machine has it (`sftjob_trainer.allocator`; an LD_PRELOAD already set, even empty, wins).

``--point`` profiles one of bench.sweep's shapes (one process) on the data and model the sweep
made under WORK/sweep (run the sweep, or at least that point, first).
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from bench.common import add_mkl_dispatch_option, pick_mkl_kernels

ROOT = Path(__file__).resolve().parent.parent

GROUPS = [
    ("matmul (linear layers, fwd+bwd)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention (sdpa kernels, sftjob's)", ("scaled_dot_product", "flash_attention", "sftjob::cpu_attention")),
    ("optimizer + clip", ("adam", "foreach", "norm")),
]
PHASES = ("data", "forward+loss", "backward", "clip+adamw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--cpu-bf16-gemm", default="auto", choices=["auto", "native", "widened"])
    add_mkl_dispatch_option(ap)
    ap.add_argument("--cpu-attention", default="auto", choices=["auto", "sdpa"],
                    help="trainer.cpu_attention: sftjob's CPU attention kernel where it applies (auto, as the "
                    "trainer) or torch's sdpa per sequence")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--point", default=None, help="a bench.sweep shape (its data under WORK/sweep)")
    ap.add_argument("--no-packing", action="store_true", help="padded micro-batches instead of packed rows")
    ap.add_argument("--budget", type=int, default=None, help="data.max_tokens_per_micro_batch (default: unset)")
    ap.add_argument("--compile", default="none", choices=["none", "layers", "mlp-norms"],
                    help="layers: trainer.compile (torch.compile per decoder layer); mlp-norms: only each layer's "
                    "MLP and norms, the pieces with no graph break (an experiment, not a trainer option)")
    ap.add_argument("--timed", type=int, default=0,
                    help="also time this many steps without the profiler and print tokens/s (default 0: no)")
    ap.add_argument("--by-shape", type=int, default=0,
                    help="also print the top N (operator, input shape) rows, token counts as T (default 0: no)")
    args = ap.parse_args()

    from sftjob_trainer.allocator import in_use, reexec_with_allocator
    reexec_with_allocator()  # as the trainer runs: before torch is loaded
    print(in_use())
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    pick_mkl_kernels(args.cpu_mkl_dispatch)
    from sftjob_trainer import cpu_attention
    print(cpu_attention.choose(args.cpu_attention))
    from transformers import AutoTokenizer

    from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig, OptimConfig
    from sftjob_trainer.data import SampleBuilder, SFTDataset
    from sftjob_trainer.batching import GlobalBatches, min_micro_batch_tokens
    from sftjob_trainer.dist import World
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model
    from sftjob_trainer.optim import build_optimizer
    from sftjob_trainer.precision import use_widened_bf16

    from bench.run import BENCH
    from bench.sweep import POINTS, made_inputs

    shape, inputs = BENCH, args.work
    if args.point:
        shape = POINTS[args.point]
        inputs = made_inputs(args.work, shape.max_len)
    model_dir, data = str(inputs / "model"), str(inputs / "data" / "train.parquet")
    world = World(0, 0, 1, torch.device("cpu"))
    gb = shape.global_batch
    cfg = DataConfig(train_files=[data], max_length=shape.max_len, train_batch_size=gb,
                     micro_batch_size_per_gpu=shape.micro_batch, packing=not args.no_packing, shuffle=False,
                     max_tokens_per_micro_batch=args.budget)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batches = GlobalBatches(SFTDataset([data], SampleBuilder(tok, cfg), "bench"), cfg, 0, 0, 1, tok.pad_token_id,
                            min_tokens=min_micro_batch_tokens(model_dir, world.device))  # as the trainer does
    widen = use_widened_bf16(world.device, args.precision, args.cpu_bf16_gemm)
    model = build_model(ModelConfig(path=model_dir), LoraConfig(), model_dir, world, widen_bf16=widen)
    if args.compile != "none":
        compile_parts(model, args.compile)
    opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-4, betas=(0.9, 0.999)), fused=True)

    def step(k: int) -> int:
        with record_function("data"):
            mbs = batches.step_batches(0, gb * k)
        n = sum(mb.n_targets for mb in mbs)
        for mb in mbs:
            with record_function("forward+loss"):
                ce = ce_sum(model, mb, world.device, args.precision)
            with record_function("backward"):
                (ce / n).backward()
        with record_function("clip+adamw"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return sum(mb.n_tokens for mb in mbs)

    model.train()
    step(0)
    if args.compile != "none":
        step(0)  # a second warm-up step, so no compile time is left in what is timed
    if args.timed:
        t0, tokens = time.perf_counter(), sum(step(k) for k in range(1, args.timed + 1))
        print(f"timed without the profiler ({args.compile=}): {args.timed} steps, "
              f"{tokens / (time.perf_counter() - t0):.0f} tokens/s")
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=args.by_shape > 0) as prof:
        profiled_tokens = sum(step(k) for k in range(1, args.steps + 1))
    if args.by_shape:
        c = model.config
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        print_by_shape(prof, args.by_shape, {c.hidden_size, c.intermediate_size, c.vocab_size,
                                             c.num_attention_heads * head, c.num_key_value_heads * head})
    events = prof.key_averages()
    if args.rows:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in events)
    shares = collections.Counter()
    for e in events:
        name = e.key.lower()
        if e.key in PHASES:      # time inside a phase but in no operator: the Python around the ops
            group = "python (time in no operator)"
        else:
            group = next((g for g, keys in GROUPS if any(k in name for k in keys)), "other (elementwise, norms, "
                         "rope, softmax/CE, copies)")
        shares[group] += e.self_cpu_time_total
    phases = {e.key: e.cpu_time_total for e in events if e.key in PHASES}
    print(f"self CPU time by kind ({args.precision}, {args.steps} steps, {total / 1e6:.1f}s):")
    for g, t in shares.most_common():
        print(f"  {g:60s} {t / total:6.1%}")
    print("wall time by phase (inclusive): " + ", ".join(f"{k} {v / 1e6:.2f}s" for k, v in phases.items()))
    # The products' own rate: the profiler's FLOP count of every mm/addmm over their self time.
    gemm = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")]
    flops, secs = sum(e.flops for e in gemm), sum(e.self_cpu_time_total for e in gemm) / 1e6
    micro = next((e.count for e in events if e.key == "forward+loss"), 0)
    print(f"GEMMs: {flops / secs / 1e9:.0f} GFLOP/s over {secs:.2f}s; {micro} micro-batches in {args.steps} steps")
    # The bound: if every operator but the GEMMs took no time, the step would be the GEMMs'.
    print(f"tokens/s: {profiled_tokens / (total / 1e6):.0f} profiled; GEMMs alone would allow "
          f"{profiled_tokens / secs:.0f} (every other operator, Python and wait at zero)")


def print_by_shape(prof, rows: int, model_dims: set[int]) -> None:
    """The top rows by (operator, input shapes). A size over 64 that is none of the model's
    own (``model_dims``) is a token count and shows as T, so one layer's product at every
    micro-batch length is one row (a row of exactly a model size's tokens stays a number)."""
    agg: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = str([["T" if d > 64 and d not in model_dims else d for d in s] if isinstance(s, list) else s
                      for s in e.input_shapes])
        a = agg[(e.key, shapes)]
        a[0] += e.count
        a[1] += e.self_cpu_time_total / 1e6
        a[2] += e.flops or 0
    total = sum(a[1] for a in agg.values())
    print(f"top {rows} by operator and input shapes (T: tokens in the row)")
    for (name, shapes), (count, secs, flops) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:rows]:
        rate = f"{flops / secs / 1e9:5.0f} GFLOP/s" if flops and secs else ""
        print(f"  {secs * 1e3:8.0f} ms {secs / total:6.1%} {int(count):6d}  {name[:40]:40s} {shapes[:64]:64s} {rate}")


def compile_parts(model, parts: str) -> None:
    import torch

    from sftjob_trainer.model import compile_layers
    if parts == "layers":
        compile_layers(model)
        return
    for layer in model.model.layers:
        for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            part.forward = torch.compile(part.forward, dynamic=True)


if __name__ == "__main__":
    main()
