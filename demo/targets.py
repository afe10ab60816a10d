"""Prometheus' scrape targets for the demo: no Prometheus Operator runs on the local
cluster, so a thread keeps Prometheus' file_sd targets equal to the live operator pods and
rank-0 trainer pods (their IPs change on every gang restart)."""
from __future__ import annotations

import threading

from demo import prom as promlib
from demo.context import Ctx

TRAINER_RANK0 = "app.kubernetes.io/managed-by=sftjob-operator,sftjob.io/rank=0"


def metrics_port(pod: dict) -> int | None:
    """The containerPort named `metrics`, where both the operator and the trainer serve."""
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == "metrics":
                return p["containerPort"]
    return None


def _scrapable(pod: dict) -> str | None:
    ip, port = pod["status"].get("podIP"), metrics_port(pod)
    running = pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
    return f"{ip}:{port}" if ip and port and running else None


def operator_targets(pods: list[dict], namespace: str) -> list[tuple[str, dict[str, str]]]:
    return [(t, {"namespace": namespace, "pod": p["metadata"]["name"]}) for p in pods if (t := _scrapable(p))]


def trainer_targets(pods: list[dict], namespace: str) -> list[tuple[str, dict[str, str]]]:
    """Labelled as the chart's PodMonitor labels them (sftjob, attempt)."""
    return [(t, {"namespace": namespace, "pod": p["metadata"]["name"],
                 "sftjob": p["metadata"]["labels"].get("sftjob.io/job-name", ""),
                 "attempt": p["metadata"]["labels"].get("sftjob.io/attempt", "")})
            for p in pods if (t := _scrapable(p))]


class TargetWriter(threading.Thread):
    """Rewrites the targets every second until stopped."""

    def __init__(self, ctx: Ctx):
        super().__init__(daemon=True, name="prometheus-targets")
        self.ctx = ctx
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.update()
            except Exception:  # noqa: BLE001 - keep going through API hiccups
                pass
            self.stopped.wait(1.0)

    def update(self) -> None:
        a, ctx = self.ctx.args, self.ctx
        ops = ctx.pods(a.system_namespace, f"app.kubernetes.io/instance={a.release}")
        promlib.set_targets(ctx.prom.workdir, "operator", operator_targets(ops, a.system_namespace))
        promlib.set_targets(ctx.prom.workdir, "trainer", trainer_targets(ctx.pods(a.namespace, TRAINER_RANK0),
                                                                         a.namespace))

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)
