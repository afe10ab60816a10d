"""The operator's work queue: which job's reconcile pass runs next, and the loop that runs them.

A key (namespace, name) is due at a time; urgent keys (a pod changed, progress moved) run
before the timers that are due, so that a new job or a lost pod never waits behind a thousand
periodic passes; a key whose pass is running is not started twice. kopf timers and daemons
would put a finalizer on every SFTJob (kopf#833), which blocks deletion while the operator is
down; this queue needs none, and it fires each job exactly when the job asked to be looked at
again (a TTL expiry, the end of a restart back-off), plus a periodic resync that catches
anything missed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("sftjob_operator")

Key = tuple[str, str]

RESYNC_S = 60.0
TICK_S = 0.2
ERROR_RETRY_S = 5.0
MAX_PARALLEL = 16


@dataclass
class WorkQueue:
    due: dict[Key, float] = field(default_factory=dict)
    urgent: set[Key] = field(default_factory=set)   # due because something happened, not a timer
    running: set[Key] = field(default_factory=set)
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    last_tick: float = field(default_factory=time.monotonic)   # the liveness probe reads it

    def enqueue(self, key: Key, after: float = 0.0, urgent: bool = False) -> None:
        """Reconcile `key` in `after` seconds (sooner if it was already due sooner)."""
        when = time.monotonic() + after
        if key not in self.due or when < self.due[key]:
            self.due[key] = when
        if urgent:
            self.urgent.add(key)

    def next_due(self, now: float, slots: int) -> list[Key]:
        """Up to `slots` due keys not running: urgent first, then the longest overdue."""
        ready = [k for k, when in self.due.items() if when <= now and k not in self.running]
        ready.sort(key=lambda k: (k not in self.urgent, self.due[k]))
        picked = ready[:max(0, slots)]
        for k in picked:
            del self.due[k]
            self.urgent.discard(k)
        return picked

    def lock(self, key: Key) -> asyncio.Lock:
        """One pass at a time per job, whichever path (handler or queue) started it."""
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: Key) -> None:
        """The job is gone."""
        self.due.pop(key, None)
        self.urgent.discard(key)
        self.locks.pop(key, None)


async def run(queue: WorkQueue, reconcile: Callable[[Key], Awaitable[None]],
              resync: Callable[[], Awaitable[None]]) -> None:
    """Run due passes, MAX_PARALLEL at a time (urgent first), and `resync` now and then. A
    pass starts only when a slot is free, so the order is decided when it starts, not when it
    became due. A pass that raises is tried again after ERROR_RETRY_S."""
    last_resync = 0.0

    async def one(key: Key) -> None:
        try:
            await reconcile(key)
        except Exception as err:  # noqa: BLE001 - a failing job must not stop the others
            log.warning("reconcile %s/%s failed: %s", *key, err)
            queue.enqueue(key, ERROR_RETRY_S)
        finally:
            queue.running.discard(key)

    while True:
        queue.last_tick = now = time.monotonic()
        for key in queue.next_due(now, MAX_PARALLEL - len(queue.running)):
            queue.running.add(key)
            asyncio.create_task(one(key))
        if now - last_resync >= RESYNC_S:
            last_resync = now
            try:
                await resync()
            except Exception as err:  # noqa: BLE001 - the next resync tries again
                log.warning("resync failed: %s", err)
        await asyncio.sleep(TICK_S)
