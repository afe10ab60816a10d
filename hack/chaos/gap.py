"""The restart gap, broken down: from the moment the operator stops a gang to the new gang's
first training step (issue 23 item 9; issue 25's "resumes within 60 s").

`PodClock` polls a job's pods and keeps, per pod, when it was created, scheduled, started,
marked for deletion and gone; a LogTap with kubelet timestamps keeps the trainers' lines. For
each gang after the first, `breakdown` splits the gap into:

| segment | from | to |
|---|---|---|
| stop | the first pod of the old gang marked for deletion (or seen failed) | the last one gone |
| relaunch | the old gang gone | the new gang's first pod created |
| schedule | created | the last pod of the gang scheduled |
| container | scheduled | rank 0's trainer container started |
| model load | container started | rank 0 logs the model loaded |
| restore | model loaded | rank 0 logs "resumed from" |
| first step | resumed | rank 0 logs its first step |

Times are the API server's (creation, conditions, container start, second resolution), the
kubelet's (log lines, sub-second) and this poller's (deletion, gone, half a second).
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

SEGMENTS = ("stop", "relaunch", "schedule", "container", "model load", "restore", "first step")
_MODEL = re.compile(r"sftjob_trainer\.model: model ")
_RESUMED = re.compile(r"resumed from ")
_STEP = re.compile(r"sftjob_trainer\.train: step \d+/\d+ ")


def rfc3339(ts: str | None) -> float | None:
    """Seconds since the epoch of a Kubernetes or kubelet timestamp (nanoseconds cut to micro)."""
    if not ts:
        return None
    ts = ts.strip().replace("Z", "+00:00")
    if "." in ts:
        head, rest = ts.split(".", 1)
        frac, tz = re.match(r"(\d+)(.*)", rest).groups()
        ts = f"{head}.{frac[:6]}{tz}"
    return datetime.fromisoformat(ts).timestamp()


@dataclass
class PodTimes:
    name: str
    attempt: str
    rank: str
    created: float | None = None
    scheduled: float | None = None
    started: float | None = None     # the trainer container
    deleting: float | None = None    # first seen with a deletionTimestamp, or ended
    gone: float | None = None        # first poll without it


@dataclass(eq=False)
class PodClock(threading.Thread):
    kube: object
    ns: str
    job: str
    interval: float = 0.5
    pods: dict[str, PodTimes] = field(default_factory=dict)   # by uid

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True, name="chaos-podclock")
        self.stopped = threading.Event()

    def poll(self) -> None:
        items = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods",
                              labelSelector=f"sftjob.io/job-name={self.job}")["items"]
        now, seen = time.time(), set()
        for p in items:
            md, st = p["metadata"], p.get("status") or {}
            uid = md["uid"]
            seen.add(uid)
            t = self.pods.setdefault(uid, PodTimes(md["name"], md.get("labels", {}).get("sftjob.io/attempt", "?"),
                                                   md.get("labels", {}).get("sftjob.io/rank", "?")))
            t.created = t.created or rfc3339(md.get("creationTimestamp"))
            cond = next((c for c in st.get("conditions") or []
                         if c["type"] == "PodScheduled" and c["status"] == "True"), None)
            t.scheduled = t.scheduled or (rfc3339(cond.get("lastTransitionTime")) if cond else None)
            for cs in st.get("containerStatuses") or []:
                if cs["name"] == "trainer":
                    t.started = t.started or rfc3339((cs["state"].get("running") or cs["state"].get("terminated")
                                                      or {}).get("startedAt"))
            if t.deleting is None and (md.get("deletionTimestamp") or st.get("phase") in ("Failed", "Succeeded")):
                t.deleting = now
        for uid, t in self.pods.items():
            if uid not in seen and t.gone is None:
                t.gone = now
                t.deleting = t.deleting or now

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the API server restarting: the next poll catches up
                pass
            self.stopped.wait(self.interval)

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


def log_lines(path: Path, since: float, until: float | None = None) -> list[tuple[float, str]]:
    """(kubelet time, line) of a LogTap file written with `timestamps`, from `since` to `until`."""
    out = []
    for raw in path.read_text(errors="replace").splitlines() if path.exists() else []:
        stamp, _, line = raw.partition(" ")
        try:
            t = rfc3339(stamp)
        except (ValueError, AttributeError):
            continue
        if t is not None and t >= since and (until is None or t <= until):
            out.append((t, line))
    return out


def log_times(path: Path, since: float) -> dict[str, float]:
    """When rank 0's trainer (the log, `timestamps` lines) loaded the model, resumed, and logged a
    step, first after `since`."""
    out: dict[str, float] = {}
    for t, line in log_lines(path, since):
        for key, pattern in (("model load", _MODEL), ("restore", _RESUMED), ("first step", _STEP)):
            if key not in out and pattern.search(line):
                out[key] = t
    return out


def marks(pods: dict[str, PodTimes], attempt: str, log: Path) -> dict[str, float | None]:
    """When (epoch seconds) each segment of the gap before gang `attempt` (an attempt label)
    ended, and `begin`; {} for the first gang or one not seen."""
    new = [t for t in pods.values() if t.attempt == attempt]
    old_attempts = sorted({t.attempt for t in pods.values() if t.attempt.isdigit() and attempt.isdigit()
                           and int(t.attempt) < int(attempt)}, key=int)
    old = [t for t in pods.values() if old_attempts and t.attempt == old_attempts[-1]]
    if not new or not old:
        return {}
    rank0 = next((t for t in new if t.rank == "0"), new[0])
    found: dict[str, float | None] = {
        "begin": min((t.deleting for t in old if t.deleting), default=None),
        "stop": max((t.gone for t in old if t.gone), default=None),
        "relaunch": min((t.created for t in new if t.created), default=None),
        "schedule": (max((t.scheduled for t in new if t.scheduled), default=None)
                     if all(t.scheduled for t in new) else None),
        "container": rank0.started,
    }
    found.update(log_times(log, rank0.created or 0.0))
    return found


def breakdown(pods: dict[str, PodTimes], attempt: str, log: Path) -> dict[str, float | None]:
    """Seconds per segment of the gap before gang `attempt`, and `total`; {} as marks()."""
    at = marks(pods, attempt, log)
    if not at:
        return {}
    out: dict[str, float | None] = {}
    prev = at["begin"]
    for seg in SEGMENTS:
        end = at.get(seg)
        out[seg] = round(end - prev, 1) if end is not None and prev is not None else None
        prev = end if end is not None else prev
    first = at.get("first step")
    out["total"] = round(first - at["begin"], 1) if first and at["begin"] else None
    return out


def describe(gap: dict[str, float | None]) -> str:
    parts = [f"{seg} {gap[seg]:.1f}s" if gap.get(seg) is not None else f"{seg} ?" for seg in SEGMENTS]
    total = gap.get("total")
    return (f"{total:.1f}s" if total is not None else "?") + " = " + " + ".join(parts)
