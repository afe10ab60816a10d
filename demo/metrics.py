"""Stage 6: the run as Prometheus saw it (loss, validation loss, tokens/s, the operator's
restarts by cause, jobs by phase), the loss curve, and a check that every query of the
chart's Grafana dashboard returns data."""
from __future__ import annotations

import math
import time

from sftjob_contract import metrics as tm
from sftjob_contract.metrics import COUNTER_SUFFIX
from sftjob_operator import metrics as om

from demo import prom as promlib
from demo.context import REPO, Ctx, shown
from demo.plot import StepAt, plot_loss

DASHBOARD = REPO / "charts" / "sftjob-operator" / "dashboards" / "sftjob.json"


def by_attempt(series: list[dict]) -> StepAt:
    """{(attempt label, timestamp): value}: each gang attempt's rank-0 pod is its own series."""
    return {(s["metric"].get("attempt"), float(t)): float(v) for s in series for t, v in s["values"]}


def _values(series: list[dict]) -> list[tuple[float, float]]:
    return [(float(t), float(v)) for s in series for t, v in s["values"]]


def losses_after_first_step(loss: list[dict], steps: StepAt) -> list[tuple[float, float, float]]:
    """(time, loss, step), time-ordered: a fresh trainer serves NaN until its first step, so
    only samples scraped after a step count."""
    lv = sorted((float(t), float(v), steps.get((s["metric"].get("attempt"), float(t)), 0))
                for s in loss for t, v in s["values"])
    return [(t, v, st) for t, v, st in lv if st > 0 and v > 0]


def last_validation(val: list[dict], steps: StepAt) -> tuple[float, float] | None:
    """(val loss, step) of the last validation: the gauge keeps its value until the next
    one, so its step is where a value first appeared."""
    first_seen: dict[float, tuple[float, float]] = {}
    for s in val:
        for t, v in s["values"]:
            st = steps.get((s["metric"].get("attempt"), float(t)), 0)
            if st > 0 and float(v) > 0:
                first_seen.setdefault(float(v), (float(t), st))
    last = max(first_seen.items(), key=lambda kv: kv[1][0], default=None)
    return (last[0], last[1][1]) if last else None


def stage_metrics(ctx: Ctx) -> None:
    out, a, prom = ctx.out, ctx.args, ctx.prom
    out.stage(6, f"Metrics from Prometheus ({prom.url}) and the loss curve")
    start, end = ctx.t_apply, max(ctx.t_end, time.time())
    sel = f'sftjob="{a.job}",namespace="{a.namespace}"'
    loss = prom.query_range(f"{tm.LOSS}{{{sel}}}", start, end, step=1)
    steps = by_attempt(prom.query_range(f"{tm.STEP}{{{sel}}}", start, end, step=1))
    val = prom.query_range(f"{tm.VAL_LOSS}{{{sel}}}", start, end, step=1)
    tps = prom.query_range(f"{tm.TOKENS_PER_SECOND}{{{sel}}}", start, end, step=1)
    restarts = om.RESTARTS_NAME + COUNTER_SUFFIX
    restart_q = f'sum by (cause) ({restarts}{{namespace="{a.system_namespace}"}})'
    before = {r["metric"].get("cause", ""): float(r["value"][1]) for r in prom.query(restart_q, at=start)}
    after_series = prom.query(restart_q, at=end)
    after = {r["metric"].get("cause", ""): float(r["value"][1]) for r in after_series}
    by_cause = {c: int(after[c] - before.get(c, 0)) for c in after}
    phases = prom.query(f'{om.JOBS_NAME} > 0', at=end)

    lv = losses_after_first_step(loss, steps)
    tv = [v for _, v in _values(tps) if math.isfinite(v)]  # NaN until a rank's first step
    out.cmd(f"curl -s '{prom.url}/api/v1/query_range?query={tm.LOSS}{{{sel}}}&...'")
    if lv:
        out.say(f"loss:      {lv[0][1]:.3f} at the start (step {int(lv[0][2])}) -> "
                f"{lv[-1][1]:.3f} at the end (step {int(lv[-1][2])})   [{len(loss)} series, "
                f"{len(lv)} samples]")
    else:
        out.say("loss:      no samples (the trainer was never scraped)")
    vv = sorted((t, v) for t, v in _values(val) if v > 0)
    if vv:
        last = last_validation(val, steps)
        at = f" (scraped at step {int(last[1])})" if last else ""
        out.say(f"val loss:  {last[0] if last else vv[-1][1]:.3f} at the last validation Prometheus saw{at}")
    if tv:
        out.say(f"tokens/s:  {sum(tv) / len(tv):.0f} on average while running (max {max(tv):.0f}), all ranks")
    out.say(f"restarts by cause ({restarts}): "
            + (", ".join(f"{c}={n}" for c, n in sorted(by_cause.items())) or "none"))
    if phases:
        out.say(f"jobs by phase ({om.JOBS_NAME}): "
                + ", ".join(f"{r['metric'].get('phase')}={float(r['value'][1]):.0f}" for r in phases))

    png = a.workdir / "loss.png"
    plot_loss(png, loss, steps, val, ctx.summary.get("preemption"), a.job)
    out.say(f"loss curve: {shown(png)}")

    checks = promlib.check_dashboard(prom, DASHBOARD, start, end)
    ok = sum(1 for *_, n in checks if n > 0)
    out.say(f"Grafana dashboard {shown(DASHBOARD)}: {ok}/{len(checks)} queries return data"
            + ("" if ok == len(checks) else "; empty: " + ", ".join(t for t, _, n in checks if n <= 0)))
    ctx.summary["prometheus"] = {
        "url": prom.url, "start": start, "end": end,
        "loss_series": len(loss), "loss_samples": len(lv),
        "loss_first": lv[0][1] if lv else None, "loss_last": lv[-1][1] if lv else None,
        "tokens_per_second_mean": (sum(tv) / len(tv)) if tv else None,
        "restart_series": len(after_series), "restarts_by_cause": by_cause,
        "dashboard": [{"panel": t, "expr": q, "series": n} for t, q, n in checks],
    }
