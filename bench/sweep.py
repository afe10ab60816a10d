"""`make bench-sweep`: the throughput bench across workload shapes (issue 30 item 1).

A user does not pick the fixed bench's shape. Each point is a Shape (bench/run.py): a data
set whose samples are capped at ``max_len`` (lognormal prompt and response lengths scaled
from the bench's 100 and 150 tokens at 512, so about half the cap on average), a global and a
micro batch, and our trainer's process count. At every point, in one run and alternated
like `make bench`, fp32:

  ours           our trainer with only the shape set: what a user who sets nothing else gets
                 (since issue 30 that is packed rows of up to micro x max_len tokens)
  ours_baseline  (with --baseline-trainer DIR) another checkout's trainer, told to pack: the
                 "before" of a change, in the same run (--baseline-as-is: with that
                 checkout's own defaults, what its user got)
  trl_packed     TRL's fastest mode here (packed rows of max_len tokens)
  plain_padfree  a hand-written padding-free loop

and on request (--contenders) bench.run's others, each with a column of its own: ours_compiled
(trainer.compile), trl_padded, trl_padfree, plain_padded.

Each contender trains until about ``--tokens`` tokens are timed (after 2 warm-up steps), so
every point costs about the same time. MFU is against the fp32 matmul peak (bench.matmul_peak;
bf16's is not measured: minutes where a CPU emulates it), measured before the first point and
again after the last, the higher of the two: a peak measured in a slow minute would flatter
every MFU of the run (on one box the same command measured 179 and 195 GFLOP/s). The
table and the verdicts (ours ÷ TRL packed ≥ 1.7 at every point; MFU ≥ 85 % at the bench
shape) go to OUT/sweep.md, the raw runs beside it.

With ``--reps N`` each point runs every contender N times, alternated (ours, TRL, plain,
ours, ...), so a slow minute of the machine falls on all of them; the table shows each
contender's median and the verdict every repetition's own ratio.

    python -m bench.sweep                          # every point (~25 min on a quiet 2-core box)
    python -m bench.sweep --points bench,L2048 --tokens 20000
    python -m bench.sweep --points 2ranks,L128 --reps 3
    git archive fd7be4e trainer contract | tar -x -C /tmp/base   # then, before/after in one run:
    python -m bench.sweep --baseline-trainer /tmp/base/trainer
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from bench.run import BENCH, OURS, PEERS, ROOT, Shape, measure_peak, prepare, run_one

POINTS: dict[str, Shape] = {
    "L128": Shape(max_len=128, global_batch=16, micro_batch=4),
    "bench": BENCH,
    "L2048": Shape(max_len=2048, global_batch=16, micro_batch=2),
    "micro1": Shape(micro_batch=1),
    "micro16": Shape(global_batch=32, micro_batch=16),
    "G64": Shape(global_batch=64, micro_batch=8),
    "2ranks": Shape(nproc=2),
}
CONTENDERS = ("ours", "ours_baseline", "trl_packed", "plain_padfree")
# bench.run's other contenders: a sweep runs them on request (a typo fails before any input is made).
EXTRA_CONTENDERS = tuple(sorted((set(OURS) | set(PEERS)) - set(CONTENDERS)))
WARMUP = 2
TRL_RATIO, MFU_AT_BENCH = 1.7, 0.85


def data_args(shape: Shape) -> tuple[str, ...]:
    """make_data.py's options for a set of this shape (the bench's own set when max_len is 512)."""
    if shape.max_len == 512:
        return ()
    k = shape.max_len / 512
    return ("--max-len", str(shape.max_len), "--prompt-mean", f"{100 * k:g}", "--response-mean", f"{150 * k:g}")


def timed_steps(shape: Shape, mean_len: float, tokens: int) -> int:
    return max(3, math.ceil(tokens / (shape.global_batch * mean_len)))


def point_inputs(name: str, shape: Shape, work: Path, out: Path, tokens: int, peak_seconds: float) -> tuple[dict, int]:
    """The point's data and model (made once under WORK/sweep/<max_len>) and its timed steps."""
    mean = 250 * shape.max_len / 512            # the set's expected mean length, to size it before it exists
    steps = timed_steps(shape, mean, tokens)
    need = max(64, (steps + WARMUP) * shape.global_batch)
    inp = prepare(work / "sweep" / f"L{shape.max_len}-n{need}", out, peak_seconds, need, threads=0,
                  data_args=data_args(shape), peak_dtypes=("fp32",))
    # Sized by the set's real mean, within the rows made (a second epoch would repeat samples).
    return inp, min(timed_steps(shape, inp["stats"]["total_len"]["mean"], tokens), need // shape.global_batch - WARMUP)


def made_inputs(work: Path, max_len: int) -> Path:
    """The inputs (data/, model/) bench.sweep made for sequences of up to max_len under
    WORK/sweep: the largest set when several --tokens made several."""
    made = [p for p in (work / "sweep").glob(f"L{max_len}-n*") if (p / "model").is_dir()]
    if not made:
        raise SystemExit(f"no sweep inputs of length {max_len} under {work / 'sweep'}: run python -m bench.sweep "
                         "(or --points with a shape of that length) first")
    return max(made, key=lambda p: int(p.name.rsplit("-n", 1)[1]))


def ratio(tokens_per_s: dict[str, float], a: str, b: str) -> float:
    return tokens_per_s[a] / tokens_per_s[b] if tokens_per_s.get(a) and tokens_per_s.get(b) else float("nan")


def times(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}×"


def pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.1%}"


def rep_ratios(row: dict, a: str, b: str) -> list[float]:
    """a ÷ b within each repetition (runs next to each other in time); [] without both."""
    runs = row.get("runs", {})
    return [x / y for x, y in zip(runs.get(a, []), runs.get(b, []))]


def median_row(row: dict) -> dict:
    """The row's tokens/s and GFLOP/s as each contender's median over its repetitions."""
    return {**row, "tokens_per_s": {c: statistics.median(v) for c, v in row["runs"].items()},
            "gflops": {c: statistics.median(v) for c, v in row["runs_gflops"].items()}}


def higher_peak(before: dict, after: dict) -> dict:
    """The run's fp32 peak: the higher of the one measured before the first point and after the last."""
    best = max(before, after, key=lambda p: p["peak_gflops_fp32"])
    return {**best, "measured_fp32": [before["peak_gflops_fp32"], after["peak_gflops_fp32"]]}


def peak_line(peak: dict) -> str:
    fp32 = peak["peak_gflops_fp32"]
    how = f"{peak['threads']} threads"
    if measured := peak.get("measured_fp32"):
        how = (f"the higher of {measured[0]:.0f} before the first point and {measured[1]:.0f} after the last, "
               + how)
    return f"fp32 matmul peak {fp32:.0f} GFLOP/s ({how}); tokens/s, MFU of ours against it"


def table(rows: list[dict], peak: dict) -> tuple[str, list[str]]:
    fp32 = peak["peak_gflops_fp32"]
    # The four usual contenders always have a column; any other that ran (ours_compiled, ...) one more.
    cols = [*CONTENDERS, *sorted({c for r in rows for c in r["tokens_per_s"]} - set(CONTENDERS))]
    lines = [peak_line(peak), "",
             "| point | max len | global | micro | ranks (ours) | steps | " + " | ".join(cols)
             + " | MFU ours | MFU TRL | MFU 1.7× TRL needs | ours ÷ TRL | baseline ÷ TRL | ours ÷ baseline "
             "| ours ÷ plain |",
             "|---" * (6 + len(cols) + 7) + "|"]
    verdicts = []
    for r in rows:
        s, t = r["shape"], r["tokens_per_s"]
        mfu = r["gflops"].get("ours", float("nan")) / fp32
        # Every contender's FLOPs are counted by one formula, so the MFU that 1.7× TRL needs
        # is TRL's MFU times 1.7: read it against the GEMMs' own rate (bench.profile_step).
        mfu_trl = r["gflops"].get("trl_packed", float("nan")) / fp32
        vs_trl, base, vs_base, vs_plain = (ratio(t, a, b) for a, b in (("ours", "trl_packed"),
                                                                       ("ours_baseline", "trl_packed"),
                                                                       ("ours", "ours_baseline"),
                                                                       ("ours", "plain_padfree")))
        lines.append(f"| {r['point']} | {s['max_len']} | {s['global_batch']} | {s['micro_batch']} | {s['nproc']} "
                     f"| {r['steps']} | " + " | ".join(f"{t[c]:.0f}" if c in t else "–" for c in cols)
                     + f" | {pct(mfu)} | {pct(mfu_trl)} | {pct(TRL_RATIO * mfu_trl)} | "
                     + " | ".join(map(times, (vs_trl, base, vs_base, vs_plain))) + " |")
        each = rep_ratios(r, "ours", "trl_packed")
        if math.isnan(vs_trl):
            verdicts.append(f"{r['point']}: ours ÷ TRL packed – (needs both runs)")
        else:
            verdicts.append(f"{r['point']}: ours ÷ TRL packed {vs_trl:.2f}× (need ≥ {TRL_RATIO}: "
                            f"{pct(TRL_RATIO * mfu_trl)} MFU) "
                            + (f"per repetition {', '.join(map(times, each))} " if len(each) > 1 else "")
                            + ("PASS" if vs_trl >= TRL_RATIO and all(x >= TRL_RATIO for x in each) else "FAIL"))
        if r["point"] == "bench":
            verdicts.append(f"bench: MFU {mfu:.1%} of the fp32 peak (need ≥ {MFU_AT_BENCH:.0%}) "
                            f"{'PASS' if mfu >= MFU_AT_BENCH else 'FAIL'}")
    return "\n".join(lines), verdicts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, from {', '.join(POINTS)}")
    ap.add_argument("--contenders", default=None,
                    help=f"comma-separated, from {', '.join(CONTENDERS)} (default: all; ours_baseline only "
                    f"with --baseline-trainer), or bench.run's others ({', '.join(EXTRA_CONTENDERS)}): "
                    "a column of their own")
    ap.add_argument("--baseline-trainer", type=Path, default=None,
                    help="a trainer/ directory (another checkout; its contract/ beside it) that ours_baseline runs")
    ap.add_argument("--baseline-as-is", action="store_true",
                    help="run ours_baseline with its checkout's own defaults (before issue 30: padded) "
                    "instead of telling it to pack")
    ap.add_argument("--tokens", type=int, default=40000, help="timed tokens per contender and point (default 40000)")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench")
    ap.add_argument("--out", type=Path, default=None, help="results (default WORK/sweep-results/<time>)")
    ap.add_argument("--peak-seconds", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=1,
                    help="runs of every contender per point, alternated; the table shows medians (default 1)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1 (got {args.reps})")
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    if unknown := [p for p in points if p not in POINTS]:
        ap.error(f"unknown points {unknown}; known: {', '.join(POINTS)}")
    contenders = (args.contenders.split(",") if args.contenders else
                  [c for c in CONTENDERS if c != "ours_baseline" or args.baseline_trainer])
    if unknown := [c for c in contenders if c not in (*CONTENDERS, *EXTRA_CONTENDERS)]:
        ap.error(f"--contenders: unknown {unknown}; known: {', '.join((*CONTENDERS, *EXTRA_CONTENDERS))}")
    if "ours_baseline" in contenders and not args.baseline_trainer:
        ap.error("ours_baseline needs --baseline-trainer DIR")
    out = args.out or args.work / "sweep-results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    peak: dict = {}
    for point in points:
        shape = POINTS[point]
        inp, steps = point_inputs(point, shape, args.work, out, args.tokens, args.peak_seconds)
        peak = inp["peak"]
        run_args = argparse.Namespace(steps=steps + WARMUP, warmup=WARMUP, threads=0, ours_extra=[],
                                      baseline_trainer=args.baseline_trainer, baseline_as_is=args.baseline_as_is)
        (out / point).mkdir(exist_ok=True)
        row: dict = {"point": point, "shape": shape.__dict__, "steps": steps, "runs": {}, "runs_gflops": {},
                     "losses": {}}
        for rep in range(1, args.reps + 1):
            for name in contenders:
                t0 = time.time()
                r = run_one(name, "fp32", rep, inp, run_args, out / point, shape)
                row["runs"].setdefault(name, []).append(r["tokens_per_s"])
                row["runs_gflops"].setdefault(name, []).append(r["model_gflops_per_s"])
                row["losses"][name] = r["final_loss"]
                print(f"[{time.strftime('%H:%M:%S')}] {point:7s} {name:14s} rep {rep} {r['tokens_per_s']:7.0f} "
                      f"tokens/s loss {r['final_loss']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        rows.append(median_row(row))
        (out / "sweep.json").write_text(json.dumps({"peak": peak, "rows": rows}, indent=1))
    if rows:
        peak = higher_peak(peak, measure_peak(out / "peak-after.json", args.peak_seconds, dtypes=("fp32",)))
        (out / "sweep.json").write_text(json.dumps({"peak": peak, "rows": rows}, indent=1))
    text, verdicts = table(rows, peak)
    if "ours_baseline" in contenders:
        how = "its own defaults" if args.baseline_as_is else "told to pack"
        text = f"ours_baseline: {args.baseline_trainer}, {how}\n" + text
    report = text + "\n\n" + "\n".join(verdicts) + "\n"
    (out / "sweep.md").write_text(report)
    print("\n" + report + f"\nraw runs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
