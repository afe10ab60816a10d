"""The operator's own Prometheus metrics (served on --metrics-port)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from .phases import Phase

# The names, for what reads them (the demo, the operator bench, the dashboard); a counter is
# exposed with COUNTER_SUFFIX appended.
RECONCILES_NAME = "sftjob_operator_reconciles"
RECONCILE_ERRORS_NAME = "sftjob_operator_reconcile_errors"
RECONCILE_SECONDS_NAME = "sftjob_operator_reconcile_duration_seconds"
JOBS_NAME = "sftjob_operator_jobs"
RESTARTS_NAME = "sftjob_operator_gang_restarts"

RECONCILES = Counter(RECONCILES_NAME, "Reconcile passes, by result.", ["result"])
RECONCILE_ERRORS = Counter(RECONCILE_ERRORS_NAME, "Reconcile passes that raised, by kind.", ["kind"])
RECONCILE_SECONDS = Histogram(RECONCILE_SECONDS_NAME, "Duration of a reconcile pass.")
JOBS = Gauge(JOBS_NAME, "SFTJobs seen by this operator, by phase.", ["phase"])
RESTARTS = Counter(RESTARTS_NAME, "Gang restarts, by cause.", ["cause"])
LEADER = Gauge("sftjob_operator_leader", "1 while this replica holds the leader Lease and acts; 0 on standby.")
TRANSITIONS = Counter("sftjob_operator_leader_acquisitions_total", "Times this replica acquired the leader Lease.")
PODS_CREATED = Counter("sftjob_operator_pods_created_total", "Training pods created.")
PHASES = tuple(Phase)
# Per job, from status.progress (eta.py); removed with the job. One series per job: what a
# platform's dashboard shows beside the queue.
JOB_PERCENT = Gauge("sftjob_operator_job_progress_percent", "Percent of a job's steps done.", ["namespace", "name"])
JOB_ETA = Gauge("sftjob_operator_job_estimated_remaining_seconds", "Estimated seconds to a job's last step.",
                ["namespace", "name"])
JOB_GOODPUT = Gauge("sftjob_operator_job_goodput_ratio", "A job's training time over its wall time since creation.",
                    ["namespace", "name"])
_JOB_GAUGES = {"percent": JOB_PERCENT, "estimated_remaining_seconds": JOB_ETA, "goodput": JOB_GOODPUT}


class PhaseBook:
    """Remembers each job's phase so that the jobs-by-phase gauge is exact."""

    def __init__(self) -> None:
        self._phase: dict[tuple[str, str], str] = {}
        for p in PHASES:
            JOBS.labels(phase=p).set(0)

    def set(self, key: tuple[str, str], phase: str | None, progress: object | None = None) -> None:
        """The job's phase (None: it is gone), and the per-job progress gauges when given."""
        if phase is None:
            self._phase.pop(key, None)
            for gauge in _JOB_GAUGES.values():
                try:
                    gauge.remove(*key)
                except KeyError:
                    pass
        else:
            self._phase[key] = phase
        for p in PHASES:
            JOBS.labels(phase=p).set(sum(1 for v in self._phase.values() if v == p))
        for field, gauge in _JOB_GAUGES.items():
            value = getattr(progress, field, None) if phase is not None else None
            if value is not None:
                gauge.labels(*key).set(value)


def serve(port: int) -> None:
    if port:
        start_http_server(port)
