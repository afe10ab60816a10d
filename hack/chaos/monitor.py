"""What `make chaos` watches while the faulty job runs: its status, its pods, the committed
checkpoints in S3 and the nodes (a node lost by someone else on a shared cluster is a fault
too, and must be counted as one)."""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from hack.localcluster.config import LOST_ANNOTATION

_STEP = re.compile(r"checkpoints/step-(\d+)/COMMITTED$")


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key.rstrip("/")


def committed_steps(s3, checkpoints_uri: str) -> set[int]:
    bucket, prefix = split_uri(checkpoints_uri)
    out: set[int] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            m = _STEP.search(o["Key"])
            if m:
                out.add(int(m.group(1)))
    return out


@dataclass
class Attempt:
    attempt: int
    seen: float                  # when the monitor first saw status.attempt at this value
    newest_committed: int | None  # newest COMMITTED checkpoint seen before that


@dataclass(eq=False)
class Monitor(threading.Thread):
    kube: Any
    s3: Any
    ns: str
    job: str
    nodes: tuple[str, ...]
    interval: float = 0.5

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True, name="chaos-monitor")
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.status: dict = {}
        self.checkpoints_uri: str | None = None
        self.committed: dict[int, float] = {}      # step -> first seen
        self.gone: dict[int, float] = {}           # step -> when it disappeared
        self.lost_checkpoints: list[str] = []      # a committed one vanished while among the newest `keep`
        self.attempts: list[Attempt] = []
        self.s3_errors = 0
        self.node_lost_seen: dict[str, list[float]] = {}   # node -> times it turned lost
        self._node_lost_now: set[str] = set()
        self.keep = 2
        self.samples: list[tuple[float, dict]] = []

    # -- queries --------------------------------------------------------------------------
    def newest_committed(self) -> int | None:
        with self.lock:
            live = [s for s in self.committed if s not in self.gone]
            return max(live) if live else None

    def max_committed_ever(self) -> int | None:
        with self.lock:
            return max(self.committed) if self.committed else None

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.status)

    # -- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopped.is_set():
            self.poll()
            self.stopped.wait(self.interval)

    def poll(self) -> None:
        now = time.time()
        try:
            job = self.kube.get(f"/apis/sftjob.io/v1alpha1/namespaces/{self.ns}/sftjobs/{self.job}")
            st = job.get("status") or {}
            with self.lock:
                self.status = st
                self.samples.append((now, st))
                att = st.get("attempt", 0)
                if not self.attempts or self.attempts[-1].attempt != att:
                    live = [s for s in self.committed if s not in self.gone]
                    self.attempts.append(Attempt(att, now, max(live) if live else None))
            self.checkpoints_uri = ((st.get("output") or {}).get("checkpointsUri")) or self.checkpoints_uri
            self.keep = ((job.get("spec") or {}).get("checkpoint") or {}).get("keep", self.keep)
        except Exception:  # noqa: BLE001 - the API hiccups while things are killed
            pass
        if self.checkpoints_uri:
            try:
                steps = committed_steps(self.s3, self.checkpoints_uri)
            except Exception:  # noqa: BLE001 - MinIO down (on purpose, sometimes)
                self.s3_errors += 1
                steps = None
            if steps is not None:
                with self.lock:
                    for s in steps:
                        self.committed.setdefault(s, now)
                        self.gone.pop(s, None)
                    for s in list(self.committed):
                        if s not in steps and s not in self.gone:
                            self.gone[s] = now
                            newer = [x for x in steps if x > s]
                            # the trainer prunes a committed checkpoint only once `keep` newer ones committed
                            if len(newer) < self.keep:
                                self.lost_checkpoints.append(
                                    f"step-{s} vanished with only {len(newer)} newer committed ({sorted(newer)}), "
                                    f"keep={self.keep}")
        try:
            for node in self.nodes:
                n = self.kube.get(f"/api/v1/nodes/{node}")
                lost = (n["metadata"].get("annotations") or {}).get(LOST_ANNOTATION) == "true"
                if lost and node not in self._node_lost_now:
                    self.node_lost_seen.setdefault(node, []).append(now)
                    self._node_lost_now.add(node)
                elif not lost:
                    self._node_lost_now.discard(node)
        except Exception:  # noqa: BLE001 - a missed node sample is taken again next poll
            pass

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)
