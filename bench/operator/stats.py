"""Statistics of the operator benchmark: percentiles of latencies, and sums and quantiles
over the samples of a Prometheus text exposition ({'name{labels}': value})."""
from __future__ import annotations

import math
import re


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def msum(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def hist_quantile(m: dict[str, float], name: str, q: float, before: dict[str, float] | None = None) -> float:
    """A quantile from a Prometheus histogram's cumulative buckets (optionally of the increase since `before`)."""
    buckets = []
    for key, v in m.items():
        if key.startswith(name + "_bucket{"):
            le = re.search(r'le="([^"]+)"', key).group(1)
            v -= (before or {}).get(key, 0.0)
            buckets.append((float("inf") if le == "+Inf" else float(le), v))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-9))
        prev_le, prev_c = le, c
    return prev_le
