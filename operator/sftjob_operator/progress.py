"""Training progress: read the rank-0 trainer's Prometheus endpoint into status.progress.

The operator, not the training pods, does the reading (an HTTP GET of the pod IP), so the
pods need no RBAC at all. Metric names are the contract's (sftjob_contract.metrics).

The endpoint is the user's pod, so nothing it serves may hurt the operator: a response is
read up to MAX_BYTES and parsed off the event loop, values that are not finite are
dropped (except the loss, which is shown as such: a NaN run must not look healthy), and
reads happen in a background `Scraper` (bounded concurrency, back-off for endpoints that do
not answer), never inside a reconcile: one unreachable pod cannot delay another job.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Hashable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from sftjob_contract import metrics as M

from .status import TIME_FORMAT, Progress

log = logging.getLogger(__name__)

# trainer metric -> (status.progress key, type)
METRICS: dict[str, tuple[str, type]] = {
    M.STEP: ("step", int),
    M.TOTAL_STEPS: ("totalSteps", int),
    M.EPOCH: ("epoch", int),
    M.LOSS: ("loss", float),
    M.TOKENS_PER_SECOND: ("tokensPerSecond", float),
    M.VAL_LOSS: ("valLoss", float),
    M.BEST_VAL_LOSS: ("bestValLoss", float),
    M.BEST_VAL_STEP: ("bestValStep", int),
    M.LAST_CHECKPOINT_STEP: ("lastCheckpointStep", int),
    M.LAST_CHECKPOINT_TIMESTAMP_SECONDS: ("lastCheckpointTime", float),   # epoch seconds -> RFC 3339 in merge()
    # Counters: Prometheus exposes them with the _total suffix.
    M.SKIPPED_STEPS + M.COUNTER_SUFFIX: ("skippedSteps", int),
    M.FAILED_CHECKPOINT_COMMITS + M.COUNTER_SUFFIX: ("failedCheckpointCommits", int),
}
# trainer per-source gauge (label M.SOURCE_LABEL) -> status.progress.sources[] key
SOURCE_METRICS: dict[str, str] = {
    M.SOURCE_ROWS: "rows",
    M.SOURCE_USABLE_ROWS: "usableRows",
    M.SOURCE_DROPPED_ROWS: "droppedRows",
    M.SOURCE_TRUNCATED_ROWS: "truncatedRows",
    M.SOURCE_TOKENS: "tokens",
    M.SOURCE_SAMPLES_PER_EPOCH: "samplesPerEpoch",
}
MAX_SOURCES = 64   # as many as data.sources allows; more is not a trainer's endpoint
SCRAPE_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 1.0
MAX_BYTES = 1 << 20          # a trainer serves a few KiB; more is not a trainer's endpoint
SCRAPE_INTERVAL_S = M.SCRAPE_INTERVAL_S
MAX_BACKOFF_S = 20.0         # an endpoint that does not answer is tried less often
MAX_CONCURRENT = 32


def parse_metrics(text: str) -> dict[str, Any]:
    """The contract's gauges from Prometheus text, keyed by status.progress names; the
    per-source preflight report as `sources`, a list in the trainer's order."""
    out: dict[str, Any] = {}
    sources: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SOURCE_METRICS:
                name = sample.labels.get(M.SOURCE_LABEL)
                if name and math.isfinite(sample.value) and (name in sources or len(sources) < MAX_SOURCES):
                    sources.setdefault(name, {"name": name})[SOURCE_METRICS[sample.name]] = int(sample.value)
                continue
            if sample.name not in METRICS:
                continue
            key, kind = METRICS[sample.name]
            if math.isfinite(sample.value):
                out[key] = kind(round(sample.value, 6)) if kind is float else kind(sample.value)
            elif sample.name == M.LOSS:
                out[key] = sample.value   # NaN or ±inf: merge() shows it as text
    if sources:
        out["sources"] = list(sources.values())
    return out


def summary(step: int | None, total: int | None) -> str | None:
    """step/totalSteps, as `kubectl get` shows it."""
    if step is None:
        return None
    return f"{step}/{total}" if total else str(step)


def merge(progress: Progress, metrics: dict[str, Any], now: str) -> Progress:
    """New status.progress from a reading (keyed by status.progress names); `updatedTime`
    moves only when a value changed, so an idle scrape does not rewrite the status."""
    if not metrics.get("totalSteps"):
        # The trainer serves its endpoint before it has loaded the data and any checkpoint;
        # its gauges read 0 until then and would wipe the last known progress.
        return progress
    metrics = dict(metrics)
    loss = metrics.pop("loss", None)
    committed = metrics.pop("lastCheckpointTime", None)
    if committed:
        metrics["lastCheckpointTime"] = datetime.fromtimestamp(committed, UTC).strftime(TIME_FORMAT)
    new = Progress.model_validate({**progress.model_dump(by_alias=True, exclude_none=True), **metrics})
    if loss is not None and math.isfinite(loss):
        new.loss, new.non_finite_loss = loss, None
    elif loss is not None:
        new.loss, new.non_finite_loss = None, "nan" if math.isnan(loss) else ("+inf" if loss > 0 else "-inf")
    if new.step != progress.step:
        new.last_step_time = now  # what the hang watchdog (runPolicy.progressDeadlineSeconds) reads
    if new.loss is not None:
        new.loss = round(new.loss, 4)
    if new.tokens_per_second is not None:
        new.tokens_per_second = round(new.tokens_per_second, 1)
    new.summary = summary(new.step, new.total_steps)
    if new.step is not None:   # the work a preemption would cost now (a restart resumes from the checkpoint)
        new.steps_since_checkpoint = new.step - (new.last_checkpoint_step or 0)
    stamps = {"updated_time", "last_step_time"}
    if new.model_dump(exclude=stamps) != progress.model_dump(exclude=stamps):
        new.updated_time = now
    return new


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """GET url (a trainer's /metrics); None when it is not serving (yet) or serves junk."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
    try:
        async with session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_BYTES + 1)
        if len(body) > MAX_BYTES:
            log.info("scrape %s: response larger than %d bytes, ignored", url, MAX_BYTES)
            return None
        return await asyncio.to_thread(parse_metrics, body.decode("utf-8", "replace"))
    except (TimeoutError, aiohttp.ClientError, ValueError, OverflowError) as err:
        log.debug("scrape %s failed: %s", url, err)
        return None


CHECKPOINT_PATH = "/checkpoint"   # the trainer's control endpoint beside /metrics (trainer/control.py)


async def ask_checkpoint(session: aiohttp.ClientSession, target: tuple[str, str] | None, hold_s: float) -> str | None:
    """POST rank 0's "checkpoint now, then hold up to hold_s" (stop_request.py); `target` is the
    Scraper's (pod UID, metrics URL) of the job. None when the trainer took it, else why not."""
    if target is None:
        return "rank 0's endpoint is not known (its pod is not running)"
    url = target[1].rsplit("/", 1)[0] + f"{CHECKPOINT_PATH}?holdSeconds={hold_s:g}"
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
    try:
        async with session.post(url, timeout=timeout) as resp:
            if resp.status == 202:
                return None
            return f"POST {url} answered {resp.status} (a trainer image without the endpoint?)"
    except (TimeoutError, aiohttp.ClientError) as err:
        return f"POST {url} failed: {err or type(err).__name__}"


def next_wait(wait: float, interval: float, answered: bool, elapsed: float) -> float:
    """Seconds until the next read of an endpoint. An endpoint that answered, or failed at
    once (connection refused: a trainer still loading its model and data has not opened its
    port yet), is read again after `interval`, so its first steps show within one interval.
    Only one that made the read wait (no answer until a timeout: a vanished pod, a black
    hole) is backed off, doubling up to MAX_BACKOFF_S, since each such read holds one of the
    MAX_CONCURRENT slots for seconds."""
    if answered or elapsed < CONNECT_TIMEOUT_S / 2:
        return interval
    return min(MAX_BACKOFF_S, wait * 2)


class Scraper:
    """Reads each running job's rank-0 endpoint every SCRAPE_INTERVAL_S in the background.

    `want(key, pod_uid, url)` starts (or keeps) reading for a job and returns the latest
    reading of that very pod; `forget(key)` stops. A reading that differs from the last
    calls `on_change(key)` so that the job is reconciled and its status updated."""

    def __init__(self, session: aiohttp.ClientSession, on_change: Callable[[Hashable], None],
                 interval: float = SCRAPE_INTERVAL_S, concurrency: int = MAX_CONCURRENT):
        self.session, self.on_change, self.interval = session, on_change, interval
        self.slots = asyncio.Semaphore(concurrency)
        self.targets: dict[Hashable, tuple[str, str]] = {}
        self.tasks: dict[Hashable, asyncio.Task[None]] = {}
        self.latest: dict[Hashable, dict[str, Any]] = {}

    def want(self, key: Hashable, pod_uid: str, url: str) -> dict[str, Any] | None:
        target = (pod_uid, url)
        if self.targets.get(key) != target:
            self.forget(key)
            self.targets[key] = target
            self.tasks[key] = asyncio.create_task(self._loop(key, url), name=f"scrape {key}")
        return self.latest.get(key)

    def forget(self, key: Hashable) -> None:
        task = self.tasks.pop(key, None)
        if task:
            task.cancel()
        self.targets.pop(key, None)
        self.latest.pop(key, None)

    def close(self) -> None:
        for key in list(self.tasks):
            self.forget(key)

    async def _loop(self, key: Hashable, url: str) -> None:
        wait = self.interval
        while True:
            started = time.monotonic()
            async with self.slots:
                reading = await scrape(self.session, url)
            wait = next_wait(wait, self.interval, reading is not None, time.monotonic() - started)
            if reading is not None:
                if reading != self.latest.get(key):
                    self.latest[key] = reading
                    self.on_change(key)
            await asyncio.sleep(wait)
