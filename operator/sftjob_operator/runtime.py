"""What one operator process holds while it runs: the API client, the work queue, the progress
scraper and its HTTP session, the phase book behind the jobs-by-phase gauge, and the settings.
Nothing here must survive a restart: the truth is in the API."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, UTC

import aiohttp

from . import metrics, progress
from .kube import Kube
from .rejections import Rejection
from .settings import Settings
from .workqueue import Key, WorkQueue


@dataclass
class Runtime:
    kube: Kube
    namespaces: list[str] | None
    session: aiohttp.ClientSession | None = None
    scraper: progress.Scraper | None = None
    queue: WorkQueue = field(default_factory=WorkQueue)
    phases: metrics.PhaseBook = field(default_factory=metrics.PhaseBook)
    task: asyncio.Task[None] | None = None
    # When this process began watching (kopf starts it only after the leader lease is won):
    # the progress watchdog counts no time before it (deadlines.progress_left).
    observing_since: datetime = field(default_factory=lambda: datetime.now(UTC))
    settings: Settings = field(default_factory=Settings)
    # A pod of the job the API server refused to create, for the job's next pass (handlers._pass).
    refused: dict[Key, Rejection] = field(default_factory=dict)

    def enqueue(self, key: Key, after: float = 0.0, urgent: bool = False) -> None:
        self.queue.enqueue(key, after, urgent)

    def forget(self, key: Key) -> None:
        """The job was deleted: drop everything this process kept for it."""
        self.phases.set(key, None)
        self.queue.forget(key)
        self.refused.pop(key, None)
        if self.scraper:
            self.scraper.forget(key)
