"""Training progress: read the rank-0 trainer's Prometheus endpoint into status.progress.

The operator, not the training pods, does the reading (an HTTP GET of the pod IP), so the
pods need no RBAC at all. Metric names are those of docs/trainer-contract.md.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# trainer metric -> (status.progress key, type)
METRICS: dict[str, tuple[str, type]] = {
    "sftjob_trainer_step": ("step", int),
    "sftjob_trainer_total_steps": ("totalSteps", int),
    "sftjob_trainer_epoch": ("epoch", int),
    "sftjob_trainer_loss": ("loss", float),
    "sftjob_trainer_tokens_per_second": ("tokensPerSecond", float),
    "sftjob_trainer_last_checkpoint_step": ("lastCheckpointStep", int),
}
SCRAPE_TIMEOUT_S = 3.0


def parse_metrics(text: str) -> dict[str, float]:
    """The contract's gauges from Prometheus text, keyed by status.progress names."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS and not math.isnan(sample.value):
                key, kind = METRICS[sample.name]
                out[key] = kind(round(sample.value, 6)) if kind is float else kind(sample.value)
    return out


def summary(progress: dict[str, Any]) -> str | None:
    step, total = progress.get("step"), progress.get("totalSteps")
    if step is None:
        return None
    return f"{step}/{total}" if total else str(step)


def merge(progress: dict[str, Any], metrics: dict[str, float], now: str) -> dict[str, Any]:
    """New status.progress; `updatedTime` moves only when a value changed, so an idle
    scrape does not rewrite the status."""
    if not metrics.get("totalSteps"):
        # The trainer serves its endpoint before it has loaded the data and any checkpoint;
        # its gauges read 0 until then and would wipe the last known progress.
        return progress
    new = {**progress, **metrics}
    if "loss" in new and new["loss"] is not None:
        new["loss"] = round(float(new["loss"]), 4)
    if "tokensPerSecond" in new and new["tokensPerSecond"] is not None:
        new["tokensPerSecond"] = round(float(new["tokensPerSecond"]), 1)
    new["summary"] = summary(new)
    new = {k: v for k, v in new.items() if v is not None}
    before = {k: v for k, v in progress.items() if k != "updatedTime"}
    after = {k: v for k, v in new.items() if k != "updatedTime"}
    if before != after:
        new["updatedTime"] = now
    return new


async def scrape(session: aiohttp.ClientSession, host: str, port: int) -> dict[str, float] | None:
    """GET http://host:port/metrics; None when the trainer is not serving yet."""
    url = f"http://{host}:{port}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        log.debug("scrape %s failed: %s", url, err)
        return None
