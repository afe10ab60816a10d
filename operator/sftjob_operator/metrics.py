"""The operator's own Prometheus metrics (served on --metrics-port)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("sftjob_operator_reconciles_total", "Reconcile passes, by result.", ["result"])
RECONCILE_ERRORS = Counter("sftjob_operator_reconcile_errors_total", "Reconcile passes that raised, by kind.",
                           ["kind"])
RECONCILE_SECONDS = Histogram("sftjob_operator_reconcile_duration_seconds", "Duration of a reconcile pass.")
JOBS = Gauge("sftjob_operator_jobs", "SFTJobs seen by this operator, by phase.", ["phase"])
RESTARTS = Counter("sftjob_operator_gang_restarts_total", "Gang restarts, by cause.", ["cause"])
PODS_CREATED = Counter("sftjob_operator_pods_created_total", "Training pods created.")
PHASES = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


class PhaseBook:
    """Remembers each job's phase so that the jobs-by-phase gauge is exact."""

    def __init__(self) -> None:
        self._phase: dict[tuple[str, str], str] = {}
        for p in PHASES:
            JOBS.labels(phase=p).set(0)

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self._phase.pop(key, None)
        else:
            self._phase[key] = phase
        for p in PHASES:
            JOBS.labels(phase=p).set(sum(1 for v in self._phase.values() if v == p))


def serve(port: int) -> None:
    if port:
        start_http_server(port)
