#!/usr/bin/env python
"""`make bench`: our trainer against TRL and a plain loop, same data, model, steps, one invocation.

Contenders (each a fresh process, alternated within every repetition so machine drift
spreads over all of them):
  ours           `python -m sftjob_trainer` (packed micro-batches of 4, as shipped), tokens/s from
                 its metrics.jsonl wall-clock stamps over the timed window
  trl_padded     HF TRL SFTTrainer, default padded collator (the loss reference)
  trl_packed     HF TRL SFTTrainer, packing=True (bfd), TRL's fastest mode here
  plain_padfree  a hand-written padding-free torch loop
  ours_compiled  (opt-in) ours with trainer.compile=true: torch.compile per decoder layer
  ours_mkl_vendor  (opt-in) ours with trainer.cpu_mkl_dispatch=vendor: oneMKL's own kernel choice
                 on an AMD CPU (what every peer gets), to show what the trainer's choice is worth
  trl_packed_mkl (opt-in) trl_packed with oneMKL's kernels chosen as our trainer chooses them
  ours_sdpa_attention  (opt-in) ours with trainer.cpu_attention=sdpa: torch's sdpa per sequence
                 instead of sftjob's CPU attention kernel, to show what the kernel is worth
  ours_baseline  (opt-in, with --baseline-trainer DIR) ours from another checkout's trainer/
                 directory (and its contract/ beside it), e.g.
                 `git archive main trainer contract | tar -x -C /tmp/base`: before/after numbers
                 in one run
each in fp32 and in bf16 autocast. Workload, timing window (steps 3..N) and the MFU formula
are those of bench/README.md. Peak RSS is the process's own, from wait4().

Usage: python -m bench.run [--reps 1] [--steps 20] [--contenders ours,trl_packed,...]
                            [--precisions fp32,bf16] [--work .bench] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import common, outputs

ROOT = Path(__file__).resolve().parents[1]

CONTENDERS = ["ours", "trl_padded", "trl_packed", "plain_padfree"]
# Variants of our trainer: the extra overrides each runs with. ours_baseline: another checkout's
# trainer (--baseline-trainer), told to pack (the default since issue 30; before it, padded), or
# with --baseline-as-is run with that checkout's own defaults (what its user got).
OURS = {"ours": [], "ours_compiled": ["trainer.compile=true"], "ours_baseline": [],
        "ours_mkl_vendor": ["trainer.cpu_mkl_dispatch=vendor"],
        "ours_sdpa_attention": ["trainer.cpu_attention=sdpa"]}
# The other contenders: the bench module each runs (python -m, from the checkout's root) and its flags.
PEERS = {
    "trl_padded": ("bench.peer_trl", ["--mode", "padded"]),
    "trl_packed": ("bench.peer_trl", ["--mode", "packed"]),
    "trl_packed_mkl": ("bench.peer_trl", ["--mode", "packed", "--cpu-mkl-dispatch", "instruction_set"]),
    "trl_padfree": ("bench.peer_trl", ["--mode", "padfree"]),
    "plain_padfree": ("bench.plain_loop", ["--mode", "padfree"]),
    "plain_padded": ("bench.plain_loop", ["--mode", "padded"]),
}
DATA_SHA = "80c74d2f"  # prefix of make_data.py's ids_sha256 for the default arguments (bench/README.md)


# --------------------------------------------------------------------------- inputs


PEAK_SIZES = "1024,2048"   # the matmul sizes the peak is measured at


def prepare(work: Path, out_dir: Path, peak_seconds: float, num_examples: int, peak_sizes: str = PEAK_SIZES,
            threads: int = 0, data_args: tuple[str, ...] = (), peak_dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict:
    """Data and the seed-0 model in the form our trainer loads (made once), and the matmul peak.
    ``data_args``: make_data.py's length options, for a set of another shape (bench.sweep);
    ``peak_dtypes``: the dtypes whose peak is measured (bench.sweep runs fp32 only)."""
    py = sys.executable
    data = work / "data"
    if not (data / "train.parquet").exists():
        subprocess.run([py, "-m", "bench.make_data", "--out", str(data), "-n", str(num_examples), *data_args],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    stats = json.loads((data / "stats.json").read_text())
    if num_examples == 512 and not data_args and not stats["ids_sha256"].startswith(DATA_SHA):
        raise SystemExit(f"bench data differ from the reference set (ids_sha256 {stats['ids_sha256']})")
    model = work / "model"
    if not (model / "config.json").exists():
        m = common.build_model(seed=0)
        m.save_pretrained(model)
        for f in (data / "tokenizer").iterdir():
            shutil.copy(f, model / f.name)
    # Measured in every invocation: the peak moves with the machine's load like the runs do.
    peak_json = out_dir / "peak.json"
    if not peak_json.exists():
        measure_peak(peak_json, peak_seconds, peak_sizes, threads, peak_dtypes)
    return {"data": data, "model": model, "peak": json.loads(peak_json.read_text()), "peak_json": peak_json,
            "stats": stats}


def measure_peak(peak_json: Path, seconds: float, sizes: str = PEAK_SIZES, threads: int = 0,
                 dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict:
    """bench.matmul_peak in a process of its own (as the contenders run), written to ``peak_json``."""
    subprocess.run([sys.executable, "-m", "bench.matmul_peak", "--json", str(peak_json), "--seconds", str(seconds),
                    "--repeats", "2", "--sizes", *sizes.split(","), "--threads", str(threads), "--dtypes", *dtypes],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(peak_json.read_text())


def check_same_tokens(data: Path, model: Path, n: int = 64) -> None:
    """Our trainer, reading the text columns with the chat template, sees the bench's token ids."""
    from transformers import AutoTokenizer

    from sftjob_contract.config import DataConfig
    from sftjob_trainer.data import IGNORE, SampleBuilder, SFTDataset

    f = str(data / "train.parquet")
    tok = AutoTokenizer.from_pretrained(model)
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], max_length=512)), "bench")
    for i, ex in enumerate(common.load_examples(data)[:n]):
        s = ds.sample(i)
        assert s.input_ids == ex["prompt_ids"] + ex["response_ids"], f"row {i}: token ids differ"
        assert [t for t in s.targets if t != IGNORE] == ex["response_ids"], f"row {i}: targets differ"


# --------------------------------------------------------------------------- runs


def run_process(cmd: list[str], log: Path, env: dict) -> tuple[int, float]:
    """Run to completion; (exit code, peak RSS MiB of the process tree's largest waited member)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024.0


@dataclass(frozen=True)
class Shape:
    """A workload shape: the data's length cap, the global and micro batch and our trainer's
    process count (the peers run one process). Ours runs with the trainer's defaults otherwise
    (packed rows of up to micro x max_len tokens); ``packing`` sets data.packing explicitly (a
    baseline checkout from before packing was the default). The defaults are the bench's."""
    max_len: int = 512
    global_batch: int = 16
    micro_batch: int = 4
    nproc: int = 1
    packing: bool | None = None

    def ours(self) -> dict[str, Any]:
        over: dict[str, Any] = {"data.max_length": self.max_len, "data.train_batch_size": self.global_batch,
                                "data.micro_batch_size_per_gpu": self.micro_batch}
        return over | ({} if self.packing is None else {"data.packing": str(self.packing).lower()})

    def peer(self, module: str) -> list[str]:
        flags = ["--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch)]
        if module == "bench.peer_trl":   # packed rows of max_len tokens hold about two samples (mean ~max_len/2)
            flags += ["--max-length", str(self.max_len), "--packed-rows", str(max(1, self.micro_batch // 2))]
        return flags


BENCH = Shape()


def contender_shape(name: str, shape: Shape, baseline_as_is: bool = False) -> Shape:
    """The shape a variant of ours runs: ours_baseline is told to pack (so a change is measured
    against the baseline's best mode) unless it is to run as its checkout's user got it."""
    return replace(shape, packing=True) if name == "ours_baseline" and not baseline_as_is else shape


def ours_command(inp: dict, out: Path, precision: str, steps: int, extra: list[str], shape: Shape = BENCH) -> list[str]:
    # The machine's peak (the faster dtype's): with bf16 products widened to fp32 GEMMs on a CPU
    # without native bf16, the bf16 peak is not the ceiling of our bf16 run.
    peak = inp["peak"]["peak_gflops"] / 1000.0
    over = {
        "model.path": inp["model"],
        "data.train_files": inp["data"] / "train.parquet",
        **shape.ours(),
        "data.shuffle": "false",
        "optim.lr": 1e-4,
        "optim.betas": "[0.9,0.999]",
        "optim.eps": 1e-8,
        "optim.weight_decay": 0.0,
        "optim.clip_grad": 1.0,
        "optim.lr_scheduler": "constant",
        "trainer.total_training_steps": steps,
        "trainer.output_dir": out,
        "trainer.precision": precision,
        "trainer.peak_tflops": repr(peak),
        "trainer.seed": 0,
    }
    args = [*[f"{k}={v}" for k, v in over.items()], *extra]
    if shape.nproc > 1:
        return [sys.executable, "-m", "sftjob_trainer.launch", "--standalone", f"--nproc-per-node={shape.nproc}",
                "--", *args]
    return [sys.executable, "-m", "sftjob_trainer", *args]


def summarize_ours(out: Path, inp: dict, precision: str, warmup: int, global_batch: int = 16) -> dict:
    """Window metrics from metrics.jsonl, computed the way common.StepMeter computes them."""
    steps = {r["step"]: r for r in outputs.step_rows(out)}
    last = max(steps)
    timed = [steps[s] for s in range(warmup + 1, last + 1)]
    seconds = steps[last]["time"] - steps[warmup]["time"]
    tokens = sum(r["tokens"] for r in timed)
    peak = inp["peak"]["peak_gflops"]  # what ours_command gave the trainer
    # FLOPs the trainer itself counted (its per-step MFU × its step time × the peak it was given) ...
    trainer_flops = sum(r["mfu"] * peak * 1e9 * r["tokens"] / r["tokens_per_s"] for r in timed)
    # ... and the bench formula on the same samples (file order, no shuffling, all rows usable).
    ex = common.load_examples(inp["data"])[warmup * global_batch : last * global_batch]
    lengths = [len(e["prompt_ids"]) + len(e["response_ids"]) for e in ex]
    assert sum(lengths) == tokens, "our trainer did not see the bench's samples in file order"
    flops = common.training_flops(common.build_model(seed=0), lengths)
    return {
        "tokens_per_s": tokens / seconds,
        "timed_seconds": seconds,
        "real_tokens": tokens,
        "final_loss": steps[last]["loss"],
        "losses": [round(steps[s]["loss"], 4) for s in sorted(steps)],
        "model_gflops_per_s": flops / seconds / 1e9,
        "mfu_trainer_reported": statistics.fmean(r["mfu"] for r in timed),
        "flops_bench_formula": flops,
        "flops_trainer": trainer_flops,
    }


def run_one(name: str, precision: str, rep: int, inp: dict, args, out_dir: Path, shape: Shape = BENCH) -> dict:
    base = out_dir / f"{name}_{precision}.r{rep}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", BENCH_PEAK_JSON=str(inp["peak_json"]), PYTHONUNBUFFERED="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if name in OURS and shape.nproc > 1:   # the machine's threads shared out among our ranks
        env["OMP_NUM_THREADS"] = str(max(1, (args.threads or os.cpu_count() or 1) // shape.nproc))
    common_flags = ["--steps", str(args.steps), "--warmup-steps", str(args.warmup)]
    if name in OURS:
        run_out = base.with_suffix(".out")
        shutil.rmtree(run_out, ignore_errors=True)
        if name == "ours_baseline":
            if not args.baseline_trainer:
                raise SystemExit("ours_baseline needs --baseline-trainer DIR (a checkout's trainer/ directory)")
            # The checkout's contract with its trainer (the config tree they were written against).
            contract = args.baseline_trainer.parent / "contract"
            paths = [args.baseline_trainer, *([contract] if contract.is_dir() else [])]
            env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")])
        run_shape = contender_shape(name, shape, getattr(args, "baseline_as_is", False))
        cmd = ours_command(inp, run_out, precision, args.steps, args.ours_extra + OURS[name], run_shape)
        code, rss = run_process(cmd, base.with_suffix(".log"), env)
        if code:
            raise SystemExit(f"{name} {precision} failed (exit {code}), see {base}.log")
        res = summarize_ours(run_out, inp, precision, args.warmup, shape.global_batch)
        outputs.drop_checkpoints_and_exports(run_out)
    else:
        module, flags = PEERS[name]
        cmd = [sys.executable, "-m", module, *flags, *common_flags, *shape.peer(module), "--data-dir", str(inp["data"]),
               "--json", str(base.with_suffix(".json"))]
        if module == "bench.peer_trl":
            cmd += ["--output-dir", str(base.with_suffix(".out"))]
        if precision == "bf16":
            cmd.append("--bf16")
        code, rss = run_process(cmd, base.with_suffix(".log"), env)
        if code:
            raise SystemExit(f"{name} {precision} failed (exit {code}), see {base}.log")
        res = json.loads(base.with_suffix(".json").read_text())
    res.update(contender=name, precision=precision, rep=rep, max_rss_mib=rss)
    base.with_suffix(".json").write_text(json.dumps(res, indent=1))
    return res


# --------------------------------------------------------------------------- report


def table(results: list[dict], peak: dict) -> tuple[str, list[str]]:
    by = {}
    for r in results:
        by.setdefault((r["contender"], r["precision"]), []).append(r)
    med = lambda key, rs: statistics.median(r[key] for r in rs)  # noqa: E731 - a one-line helper for the table below
    lines = [
        f"peak (matmul_peak.py): fp32 {peak['peak_gflops_fp32']:.0f} GFLOP/s, "
        f"bf16 {peak['peak_gflops_bf16']:.0f} GFLOP/s, {peak['threads']} threads",
        "",
        "| contender | precision | runs | tokens/s (median) | min..max | MFU vs own-dtype peak | MFU vs machine peak "
        "| trainer-reported MFU | peak RSS MiB | final loss | ours ÷ this |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for precision in ("fp32", "bf16"):
        ours = by.get(("ours", precision))
        for name in CONTENDERS + sorted({c for c, _ in by} - set(CONTENDERS)):
            rs = by.get((name, precision))
            if not rs:
                continue
            tps = [r["tokens_per_s"] for r in rs]
            gflops = statistics.median(r["model_gflops_per_s"] for r in rs)
            own, best = gflops / peak[f"peak_gflops_{precision}"], gflops / peak["peak_gflops"]
            reported = f"{med('mfu_trainer_reported', rs):.1%}" if "mfu_trainer_reported" in rs[0] else "–"
            ratio = f"{med('tokens_per_s', ours) / statistics.median(tps):.2f}×" if ours and name != "ours" else ""
            lines.append(
                f"| {name} | {precision} | {len(rs)} | {statistics.median(tps):.0f} | {min(tps):.0f}..{max(tps):.0f} "
                f"| {own:.1%} | {best:.1%} | {reported} | {med('max_rss_mib', rs):.0f} "
                f"| {med('final_loss', rs):.4f} | {ratio} |"
            )
        if not ours:
            continue
        o = med("tokens_per_s", ours)
        if (trl := by.get(("trl_packed", precision))):
            t = med("tokens_per_s", trl)
            checks.append(f"{precision}: ours ÷ TRL best (packed) = {o / t:.2f}× (need ≥ 1.30) "
                          f"{'PASS' if o >= 1.3 * t else 'FAIL'}")
        for variant in ("ours_compiled", "ours_baseline", "ours_mkl_vendor", "ours_sdpa_attention"):
            if (v := by.get((variant, precision))):
                vs = med("tokens_per_s", v)
                vs_trl = f", ÷ TRL packed = {vs / med('tokens_per_s', trl):.2f}×" if trl else ""
                checks.append(f"{precision}: {variant} ÷ ours = {vs / o:.2f}×{vs_trl}")
        if (trl_mkl := by.get(("trl_packed_mkl", precision))):
            vs = o / med("tokens_per_s", trl_mkl)
            checks.append(f"{precision}: ours ÷ TRL packed with our oneMKL kernels = {vs:.2f}×")
        if (plain := by.get(("plain_padfree", precision))):
            p = med("tokens_per_s", plain)
            checks.append(f"{precision}: ours ÷ plain padding-free loop = {o / p:.2f}× (need ≥ 1.00) "
                          f"{'PASS' if o >= p else 'FAIL'}")
        if (padded := by.get(("trl_padded", precision))):
            lo, lt = med("final_loss", ours), med("final_loss", padded)
            checks.append(f"{precision}: final loss ours {lo:.4f} vs TRL padded {lt:.4f}: {abs(lo - lt) / lt:.2%} "
                          f"(need ≤ 2%) {'PASS' if abs(lo - lt) <= 0.02 * lt else 'FAIL'}")
        trls = [r for (c, p), rs in by.items() if c.startswith("trl") and p == precision for r in rs]
        if trls:
            mine, theirs = med("max_rss_mib", ours), min(r["max_rss_mib"] for r in trls)
            checks.append(f"{precision}: peak RSS ours {mine:.0f} MiB vs TRL (lowest mode) {theirs:.0f} MiB "
                          f"{'PASS' if mine <= theirs else 'FAIL'}")
        rel = max(abs(r["flops_trainer"] / r["flops_bench_formula"] - 1) for r in ours)
        checks.append(f"{precision}: FLOPs the trainer counted vs its formula on the bench's samples: "
                      f"max rel. diff {rel:.1e} "
                      f"{'PASS' if rel < 1e-6 else 'FAIL'}")
    return "\n".join(lines), checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=int(os.environ.get("REPS", 1)))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every contender (0: torch default)")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench", help="data, model and peak are cached here")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default WORK/results/<time>)")
    ap.add_argument("--num-examples", type=int, default=512)
    ap.add_argument("--peak-seconds", type=float, default=1.0)
    ap.add_argument("--peak-sizes", default="1024,2048", help="matmul sizes for the peak measurement")
    ap.add_argument("--ours-extra", nargs="*", default=[], help="extra key=value overrides for our trainer")
    ap.add_argument("--baseline-trainer", type=Path, default=None,
                    help="a trainer/ directory (another checkout; its contract/ beside it) that ours_baseline runs")
    ap.add_argument("--baseline-as-is", action="store_true",
                    help="run ours_baseline with its checkout's own defaults instead of telling it to pack")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or args.work / "results" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    inp = prepare(args.work, out_dir, args.peak_seconds, args.num_examples, args.peak_sizes, args.threads)
    check_same_tokens(inp["data"], inp["model"])
    contenders = args.contenders.split(",")
    precisions = args.precisions.split(",")
    unknown = set(contenders) - set(PEERS) - set(OURS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {', '.join([*OURS, *PEERS])}")

    results = []
    for rep in range(1, args.reps + 1):
        for precision in precisions:
            for name in contenders:
                t0 = time.time()
                r = run_one(name, precision, rep, inp, args, out_dir)
                results.append(r)
                print(f"[{time.strftime('%H:%M:%S')}] rep {rep} {name:14s} {precision}: "
                      f"{r['tokens_per_s']:7.0f} tokens/s loss {r['final_loss']:.4f} "
                      f"rss {r['max_rss_mib']:.0f} MiB ({time.time() - t0:.0f}s)", flush=True)
    text, checks = table(results, inp["peak"])
    report = text + "\n\n" + "\n".join(checks) + "\n"
    (out_dir / "results.md").write_text(report)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + report + f"\nraw runs: {out_dir}")


if __name__ == "__main__":
    main()
