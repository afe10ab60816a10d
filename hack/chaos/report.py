"""What the chaos run checks and prints: each fault's observed effect, the restart counters
by cause, where every restart resumed, the S3 retries and the final weights against the
reference run's."""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from .faults import PREEMPTION, Fault
from .harness import Ctx, restarts
from .monitor import Monitor
from .weights import Comparison, compare_dirs, download

_RESUMED = re.compile(r"resumed from \S*/checkpoints/step-(\d+)")
_SCRATCH = "no committed checkpoint under"


def attribute(faults: list[Fault], mon: Monitor, end: dict) -> None:
    """Each fault's observed effect: the restart counters from its injection to the next one's."""
    for k, f in enumerate(faults):
        after = faults[k + 1].extra["restarts_before"] if k + 1 < len(faults) else restarts(end)
        before = f.extra["restarts_before"]
        d = {c: after[c] - before[c] for c in before}
        exp = {"preemptions": 1 if f.expected_cause == PREEMPTION else 0, "failures": 0}
        f.ok = d == exp
        parts = [f"preemptions +{d['preemptions']}", f"failures +{d['failures']}"]
        if f.kind.startswith("operator-kill") or f.kind == "operator-down-long":
            parts.append(f"operator back ({len(f.extra.get('operators_after', []))} pods, new ones)")
        if "throttled" in f.extra:   # a throttling fault that refused nothing tested nothing
            parts.append(f"{f.extra['throttled']} requests throttled")
            f.ok = f.ok and f.extra["throttled"] > 0
        f.observed = ", ".join(parts)
        # why the operator restarted the gang (the Restarting condition's message at the time)
        reasons = []
        for t, st in mon.samples:
            if f.t <= t < (faults[k + 1].t if k + 1 < len(faults) else float("inf")):
                for c in st.get("conditions") or []:
                    if c.get("type") == "Restarting" and c.get("status") == "True":
                        r = (c.get("reason") or "") + ": " + (c.get("message") or "")[:90]
                        if r not in reasons:
                            reasons.append(r)
        f.extra["restart_reasons"] = reasons


def rank0_log(ctx: Ctx, name: str) -> Path:
    """The rank-0 pod's log as the run's LogTap keeps it: re-created pods of the same name
    append to it."""
    return ctx.tap.path(f"{name}-node-0", "trainer")


def check_resumes(ctx: Ctx, name: str, mon: Monitor, offset: int) -> tuple[list[str], list[str]]:
    """Every gang attempt after the first resumed from the newest checkpoint committed before
    it (or a newer one): (report lines, problems)."""
    lines, problems = [], []
    path = rank0_log(ctx, name)
    pod_dir = path.parent
    text = ""
    if path.exists():
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    resumes = []
    for line in text.splitlines():
        m = _RESUMED.search(line)
        if m:
            resumes.append(int(m.group(1)))
        elif _SCRATCH in line:
            resumes.append(0)
    lines.append(f"rank-0 starts: {len(resumes)} (resumed at steps {resumes}); gang attempts seen "
                 f"{[x.attempt for x in mon.attempts]}")
    if not resumes:
        problems.append(f"no start line in {pod_dir}")
        return lines, problems
    if resumes[0] != 0:
        problems.append(f"the first attempt did not start from scratch ({resumes[0]})")
    # The n-th start belongs to an attempt at or after the n-th attempt seen; the newest
    # committed checkpoint before that attempt is a lower bound for where it resumed.
    committed = set(mon.committed)
    floor = None
    prev = 0
    for n, step in enumerate(resumes[1:], start=1):
        if n < len(mon.attempts):
            floor = mon.attempts[n].newest_committed
        if step and step not in committed:
            problems.append(f"start {n} resumed from step-{step}, never seen COMMITTED in S3")
        if floor is not None and step < floor:
            problems.append(f"start {n} resumed from step-{step} although step-{floor} was committed before "
                            f"the restart: a committed checkpoint was lost")
        if step < prev:
            problems.append(f"start {n} resumed from step-{step}, older than the previous start's step-{prev}")
        prev = step
    problems += mon.lost_checkpoints
    lines.append(f"COMMITTED checkpoints seen in S3: {sorted(mon.committed)}; pruned by keep={mon.keep}: "
                 f"{sorted(mon.gone)}; vanished early: {len(mon.lost_checkpoints)}")
    return lines, problems


def short(target: str) -> str:
    """Operator pod names without the release prefix (the table stays readable)."""
    return ",".join(t.rsplit("-", 2)[-2] + "-" + t.rsplit("-", 1)[-1] if t.count("-") > 3 and "operator" in t else t
                    for t in target.split(","))


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731 - a one-line row formatter
    return [fmt(header), fmt(["-" * x for x in w])] + [fmt(r) for r in rows]


def report_faults(args: argparse.Namespace, faults: list[Fault], mon: Monitor, end: dict) -> list[str]:
    """Print each fault with its expected and observed effect; the problems found."""
    problems: list[str] = []
    attribute(faults, mon, end)
    print()
    print(f"Faults (seed {args.seed:d}):")
    rows = [[f.index, f.kind, f.at_step if f.at_step is not None else "?", short(f.target), f.expected, f.observed,
             "ok" if f.ok else "MISMATCH"] for f in faults]
    for line in table(rows, ["#", "fault", "step", "target", "expected effect", "observed", ""]):
        print("  " + line)
    for f in faults:
        if f.extra.get("restart_reasons"):
            print(f"  #{f.index} {f.kind}: operator said " + " | ".join(f.extra["restart_reasons"][:2]))
        if not f.ok:
            problems.append(f"fault #{f.index} {f.kind}: expected {f.expected}, observed {f.observed}")
    kinds_used = sorted({f.kind for f in faults})
    if len(faults) < args.min_faults:
        problems.append(f"only {len(faults)} faults injected (< {args.min_faults})")
    if len(kinds_used) < args.min_kinds:
        problems.append(f"only {len(kinds_used)} kinds injected {kinds_used} (< {args.min_kinds})")
    return problems


def report_restarts(faults: list[Fault], mon: Monitor, st: dict) -> tuple[int, list[str]]:
    """Print the restart counters in status against the faults injected, by cause; (the
    preemptions expected, the problems found)."""
    problems: list[str] = []
    external = {n: ts for n, ts in mon.node_lost_seen.items()
                if len(ts) > sum(1 for f in faults if f.kind == "node-lost" and f.target == n)}
    exp_pre = sum(1 for f in faults if f.expected_cause == PREEMPTION)
    got = restarts(st)
    print()
    print("Restart counters in status vs faults injected, by cause:")
    crow = [["preemption", exp_pre, got["preemptions"], "ok" if got["preemptions"] == exp_pre else "MISMATCH"],
            ["failure", 0, got["failures"], "ok" if got["failures"] == 0 else "MISMATCH"],
            ["total", exp_pre, (st.get("restarts") or {}).get("total", 0),
             "ok" if (st.get("restarts") or {}).get("total", 0) == exp_pre else "MISMATCH"]]
    for line in table(crow, ["cause", "injected", "status.restarts", ""]):
        print("  " + line)
    if any(r[-1] != "ok" for r in crow):
        problems.append(f"status.restarts {st.get('restarts')} != {exp_pre} preemptions and 0 failures injected")
    if external:
        problems.append(f"nodes lost by someone else during the run (shared cluster): {sorted(external)}; "
                        "rerun when the cluster is quiet")
    return exp_pre, problems


def report_checkpoints(ctx: Ctx, run_name: str, mon: Monitor, offset: int, rank_logs: list[Path],
                       offsets: list[int], faults: list[Fault]) -> tuple[int, list[str]]:
    """Print where every restart resumed and how many S3 requests the trainers retried (their
    logs from the given offsets); (the retries, the problems found)."""
    print()
    print("Checkpoints:")
    lines, problems = check_resumes(ctx, run_name, mon, offset)
    for line in lines:
        print("  " + line)
    retries = 0
    for p, off in zip(rank_logs, offsets):
        if p.exists():
            with open(p, "rb") as fh:
                fh.seek(off)
                retries += len(re.findall(rb"attempt \d+ failed \(", fh.read()))
    n_outages = sum(1 for f in faults if f.kind == "minio-outage")
    print(f"  S3 requests the trainers retried (log warnings): {retries}"
          + (f" (across {n_outages} MinIO outage(s))" if n_outages else ""))
    return retries, problems


def report_weights(ctx: Ctx, workdir: Path, ref: dict, st: dict) -> Comparison | None:
    """Download both runs' final weights and print their comparison; None when a job did not
    succeed."""
    print()
    print("Final weights (hf/final, safetensors), reference vs faulty run:")
    ru, fu = (ref["status"].get("output") or {}).get("uri"), (st.get("output") or {}).get("uri")
    if not (ru and fu and st.get("phase") == "Succeeded"):
        print("  not compared: a job did not succeed")
        return None
    da, db = workdir / "reference", workdir / "faulty"
    for d in (da, db):
        shutil.rmtree(d, ignore_errors=True)
    download(ctx.s3, ru, da)
    download(ctx.s3, fu, db)
    cmp = compare_dirs(da, db)
    for line in cmp.lines():
        print("  " + line)
    print(f"  {ru}\n  {fu}")
    return cmp
