"""The reconcile decision: (job, observed pods, clock) -> a plan. Pure; no I/O.

Level-based: every pass recomputes everything from the SFTJob (spec + status) and the pods
it observes, so a pass can be repeated or interrupted at any point. Everything the operator
must remember lives in the job's status (attempt, launchedAttempt, restartAfter, ...), and
the handler writes the new status *before* acting on it; a crash between the two leaves a
status from which the next pass finishes the same actions. The one exception is
`launchedAttempt`, written only after all pods of an attempt exist, so that a crash in
the middle of creating a gang re-creates only the missing ranks and is not mistaken for a
preemption; and when that write itself is lost (the operator died, or the write failed,
after the last pod was created), a later pass that finds every rank of the attempt adopts
the gang as launched instead of launching it again forever.

Nothing waits without saying why: pods that cannot start put their reason (a missing
Secret, Unschedulable, ...) in the job's conditions; pods the API server refuses to create
fail the job naming the spec field (`rejections.py`); an old gang stuck terminating on a
lost node is force-deleted (`stale.py`); a gang whose step stops advancing is restarted by
the progress watchdog. This module sequences the stages; each policy is a pure, table-tested
module: failure_policy, success, suspend, deadlines, ttl, stale, queueing (Kueue).
"""
from __future__ import annotations

from datetime import datetime, timedelta, UTC
from typing import Any

from sftjob_contract import layout

from . import builders, deadlines, edits, elastic, eta, failure_policy as fp
from . import conditions as c
from . import progress as prog
from . import queueing, stale, stop_request, success, suspend, ttl
from .phases import TERMINAL, Phase, RestartCause
from .plan import Event, Plan
from .rejections import Rejection, explain_waiting
from .status import dump, fields_patch, iso, parse, parse_time

# A running job is looked at again at least this often; its progress arrives sooner, as the
# background scraper reads it (progress.Scraper asks for a pass whenever a reading changes).
PROGRESS_INTERVAL_S = 15.0
STARTING_POLL_S = 5.0        # how often a starting gang is re-checked besides pod events
STALE_POLL_S = 2.0           # while old pods finish terminating
SETTLE_POLL_S = 2.0          # while a failure waits for a peer node's heartbeat (settle_generic_failure)
QUOTA_RETRY_S = 10.0         # how often a gang waiting for namespace quota is tried again


class _Pass:
    """One reconcile pass over one job; builds a Plan."""

    def __init__(self, body: dict[str, Any], pods: list[dict[str, Any]], now: datetime,
                 node_ready: dict[str, fp.NodeReadiness] | None, metrics: dict[str, float] | None,
                 rejection: Rejection | None = None, node_leases: dict[str, fp.NodeLease] | None = None,
                 observing_since: datetime | None = None, cluster_nodes: list[dict[str, Any]] | None = None):
        self.body = body
        self.meta = body["metadata"]
        self.job = builders.JobRef.from_body(body)
        self.generation = self.meta.get("generation")
        self.st = parse(body.get("status"))   # the one read of the stored status; edited in place
        self.old = self.st.model_copy(deep=True)
        self.pods = [p for p in pods if any(o.get("uid") == self.job.uid
                                            for o in p["metadata"].get("ownerReferences") or [])]
        self.now = now
        self.node_ready = node_ready or {}
        self.node_leases = node_leases or {}
        self.metrics = metrics
        self.rejection = rejection
        self.observing_since = observing_since
        self.cluster_nodes = cluster_nodes   # the cluster's Nodes, read for an elastic job (elastic.py)
        self.queued = False   # the current gang waits for Kueue's admission (judge)
        self.plan = Plan()

    # -- helpers ------------------------------------------------------------------------
    def set_phase(self, phase: Phase, reason: str, message: str) -> None:
        self.st.phase = phase
        self.st.message = message[: c.MAX_MESSAGE]
        self.st.conditions = c.for_phase(self.st.conditions, phase, reason, message, iso(self.now), self.generation)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.plan.events.append(Event(type_, reason, message))

    def reason_changed_to(self, reason: str) -> bool:
        """Whether the job's Ready condition did not carry `reason` before this pass (an
        Event for a waiting reason is posted once, not on every pass)."""
        ready = c.get_condition(self.old.conditions, c.READY)
        return not ready or ready.reason != reason

    def requeue(self, seconds: float) -> None:
        seconds = max(0.5, seconds)
        if self.plan.requeue_after is None or seconds < self.plan.requeue_after:
            self.plan.requeue_after = seconds

    def stop(self, pods: list[dict[str, Any]], finished_too: bool = False) -> None:
        chosen = pods if finished_too else fp.pods_to_stop(pods)
        for p in chosen:
            if not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in self.plan.delete_pods:
                self.plan.delete_pods.append(p["metadata"]["name"])

    def fail(self, reason: str, message: str) -> None:
        self.set_phase(Phase.FAILED, reason, message)
        self.st.completion_time = iso(self.now)
        self.st.restart_after = None
        self.event("Warning", reason, message)
        self.cleanup_finished()

    def cleanup_finished(self) -> None:
        """Pods of a finished job: running ones always stop; finished ones per cleanPodPolicy."""
        policy = self.spec.run_policy.clean_pod_policy
        self.stop(self.pods, finished_too=(policy == "All"))
        done = parse_time(self.st.completion_time) or self.now
        left = ttl.seconds_left(done, self.spec.run_policy.ttl_seconds_after_finished, self.now)
        if left is not None and left <= 0:
            self.plan.delete_job = True
        elif left is not None:
            self.requeue(left)

    # -- the pass -----------------------------------------------------------------------
    def run(self) -> Plan:
        try:
            self.spec = builders.parse_spec(self.body.get("spec") or {})
            builders.trainer_config(self.job, self.spec)
        except builders.InvalidSpec as err:
            self.st.observed_generation = self.generation   # observed, and judged: it cannot run
            if self.st.phase != Phase.FAILED:
                self.set_phase(Phase.FAILED, c.REASON_INVALID_SPEC, str(err))
                self.st.completion_time = iso(self.now)
                self.event("Warning", c.REASON_INVALID_SPEC, str(err))
            self.plan.invalid = str(err)
            return self.finish()
        edits.observe(self.st, self.spec, self.generation, iso(self.now))
        self.st.output.checkpoints_uri = f"{builders.output_dir(self.job, self.spec)}/{layout.CHECKPOINTS}"

        if self.st.phase in TERMINAL:
            self.cleanup_finished()
            return self.finish()
        if self.st.phase is None:
            self.set_phase(Phase.PENDING, c.REASON_CREATED, "waiting for the gang to be created")
        todo = suspend.step(self.st.phase, self.spec.suspend)
        if todo in (suspend.Step.SUSPEND, suspend.Step.SUSPENDED):
            if todo is suspend.Step.SUSPEND and not stop_request.ready_to_stop(self, "suspend"):
                return self.finish()
            suspend.apply(self, todo, STALE_POLL_S)
            return self.finish()
        if todo is suspend.Step.RESUME:
            self.set_phase(Phase.PENDING, c.REASON_RESUMED, "resuming from the newest checkpoint")
            self.st.restart_after = None
            self.event("Normal", c.REASON_RESUMED, "resuming from the newest checkpoint")
        self.active()
        return self.finish()

    def active(self) -> None:
        attempt = self.st.attempt
        current = {builders.pod_rank(p): p for p in self.pods if builders.pod_attempt(p) == attempt}
        old_gang = [p for p in self.pods if builders.pod_attempt(p) != attempt]
        rp = self.spec.run_policy
        # Checked before anything else waits: a gang stuck terminating ends at the deadline too.
        left = deadlines.active_left(parse_time(self.st.start_time), rp.active_deadline_seconds, self.now)
        if left is not None:
            if left <= 0:
                self.fail(c.REASON_DEADLINE, f"runPolicy.activeDeadlineSeconds ({rp.active_deadline_seconds}) exceeded")
                return
            self.requeue(left)
        if old_gang:
            # An earlier gang still exists (or is still checkpointing): let it go first.
            self.wait_for_stale(old_gang)
            return
        restart_after = parse_time(self.st.restart_after)
        if restart_after and self.now < restart_after:
            self.requeue((restart_after - self.now).total_seconds())
            return
        if self.st.launched_attempt != attempt:
            if self.rejection is not None:
                self.rejected(self.rejection, current)
                return
            if not current:
                elastic.size_new_gang(self)
            if len(current) < self.size:
                self.launch(attempt, current)
                return
            # Every rank exists but the launch was never recorded: adopt the gang.
            self.st.launched_attempt = attempt
            created = [p["metadata"].get("creationTimestamp") for p in current.values()]
            self.st.launch_time = max([t for t in created if t] or [iso(self.now)])
        self.judge(attempt, current)

    def wait_for_stale(self, old_gang: list[dict[str, Any]]) -> None:
        """Stop an earlier gang and wait for it (stale.py: when a lingering pod is force-deleted)."""
        self.stop(old_gang, finished_too=True)
        self.requeue(STALE_POLL_S)
        for pod in stale.lingering(old_gang, self.node_ready, self.now):
            if pod.force_delete and pod.pod not in self.plan.force_delete_pods:
                self.plan.force_delete_pods.append(pod.pod)
                self.event("Warning", c.REASON_FORCE_DELETED, pod.message)
            elif not pod.force_delete and self.st.phase in (Phase.PENDING, Phase.RESTARTING):
                self.set_phase(self.st.phase, c.REASON_TERMINATING, pod.message)

    @property
    def size(self) -> int:
        """Pods in the current gang (an elastic job's size; else resources.nodes)."""
        return self.st.nodes or self.spec.resources.nodes

    def launch(self, attempt: int, current: dict[int, dict[str, Any]]) -> None:
        nodes = self.size
        group = queueing.pod_group(self.meta, self.job.uid, attempt, nodes)
        gang_spec = elastic.gang_spec(self.spec, nodes)
        self.plan.launch = [builders.build_pod(self.job, gang_spec, r, attempt, group=group)
                            for r in range(nodes) if r not in current]
        if group[0]:
            name = group[0][queueing.GROUP_LABEL]
            self.set_admitted(False, queueing.REASON_WAITING,
                              queueing.queued_message(queueing.queue_name(self.meta), name, []))
        self.st.output.uri = builders.model_uri(self.job, self.spec)   # what this gang will write
        self.plan.launched_status = fields_patch(launched_attempt=attempt, launch_time=iso(self.now),
                                                 launched_generation=self.generation,
                                                 launched_spec=edits.fingerprint(self.spec))
        self.requeue(STARTING_POLL_S)

    def rejected(self, rej: Rejection, current: dict[int, dict[str, Any]]) -> None:
        """The API server refused a pod of the gang. What no retry can fix fails the job,
        naming the spec field; a full namespace quota is waited for (saying so) until the
        startup deadline."""
        if rej.permanent:
            self.fail(rej.reason, rej.message)  # which stops the part of the gang that exists
            return
        rp = self.spec.run_policy
        # Waiting since the job last stopped being Ready (created, or restarted): stable
        # across the retries below, unlike restartAfter.
        ready = c.get_condition(self.st.conditions, c.READY)
        since = parse_time(ready.last_transition_time if ready else None) or self.now
        if deadlines.startup_left(since, rp.startup_deadline_seconds, self.now) <= 0:
            self.fail(c.REASON_STARTUP_DEADLINE,
                      f"pods could not be created for {rp.startup_deadline_seconds}s "
                      f"(runPolicy.startupDeadlineSeconds): {rej.message}")
            return
        if self.reason_changed_to(rej.reason):
            self.event("Warning", rej.reason, rej.message)
        self.set_phase(Phase.PENDING, rej.reason, rej.message)
        if current:
            # Part of the gang exists: it would hold quota while waiting for the rest (and its
            # rendezvous would time out). Retire it, uncounted, and try the whole gang again.
            self.stop(list(current.values()), finished_too=True)
            self.st.attempt += 1
        self.st.restart_after = iso(self.now + timedelta(seconds=QUOTA_RETRY_S))
        self.requeue(QUOTA_RETRY_S)

    def set_admitted(self, admitted: bool, reason: str, message: str) -> None:
        """The `Admitted` condition of a job queued by Kueue; its lastTransitionTime to True
        is when the operator saw the gang's gates removed (the startup deadline starts then)."""
        self.st.conditions = c.set_condition(self.st.conditions, queueing.ADMITTED, admitted, reason, message,
                                             iso(self.now), self.generation)

    def track_admission(self, current: dict[int, dict[str, Any]]) -> bool:
        """For a gang in a Kueue pod group: record whether it is admitted. True while any
        pod of the gang is still gated (queued)."""
        admission = queueing.admission(list(current.values()))
        if admission is None:
            return False
        self.set_admitted(admission.admitted, admission.reason, admission.message)
        return admission.queued

    def judge(self, attempt: int, current: dict[int, dict[str, Any]]) -> None:
        nodes = self.size
        self.queued = self.track_admission(current)
        outcomes: dict[int, fp.PodOutcome | None] = {r: fp.classify_pod(p, fp.node_ready_for(
                        p, self.node_ready.get((p.get("spec") or {}).get("nodeName", ""))))
                    for r, p in current.items()}
        outcomes, settle_s = fp.settle_generic_failure(outcomes, current, self.node_leases, self.now)
        verdict = fp.judge_gang(outcomes, nodes)
        if verdict.verdict is fp.Verdict.RESTART_FAILED and settle_s > 0:
            # a peer's node has not shown a heartbeat since: a failure, or a dead machine's echo?
            self.requeue(min(settle_s, SETTLE_POLL_S))
            return
        rp = self.spec.run_policy
        if verdict.verdict is fp.Verdict.FAILED:
            self.fail(verdict.reason, f"{verdict.message} (a deterministic error: the trainer exited 2, and "
                      "retrying cannot help; fix the spec or the data and create the job again)")
        elif verdict.verdict is fp.Verdict.SUCCEEDED:
            success.apply(self, current)
        elif verdict.verdict is fp.Verdict.RESTART_FAILED:
            self.attempt_failed(verdict, current)
        elif verdict.verdict is fp.Verdict.RESTART_PREEMPTED:
            if self.st.restarts.preemptions >= rp.preemption_limit:
                self.fail(c.REASON_PREEMPTION_LIMIT,
                          f"{c.REASON_PREEMPTION_LIMIT}: runPolicy.preemptionLimit ({rp.preemption_limit}) "
                          f"reached; last: {verdict.message}")
            else:
                self.restart(RestartCause.PREEMPTION, verdict, current)
        elif verdict.verdict is fp.Verdict.STARTING:
            if not elastic.shrink_starting(self, verdict.stuck_reason, current):
                self.starting(verdict)
        else:
            if self.st.phase != Phase.RUNNING:
                self.set_phase(Phase.RUNNING, c.REASON_ALL_RUNNING, f"all {nodes} pods running (attempt {attempt})")
                self.event("Normal", c.REASON_ALL_RUNNING, f"all {nodes} pods running (attempt {attempt})")
            self.st.start_time = self.st.start_time or iso(self.now)
            if self.metrics:
                self.st.progress = eta.update(self.st.progress, prog.merge(self.st.progress, self.metrics, iso(
                    self.now)), self.st.attempt, self.now, parse_time(self.meta.get("creationTimestamp")))
            self.requeue(PROGRESS_INTERVAL_S)
            if not elastic.resize_running(self, current):
                self.watchdog(current)

    def starting(self, verdict: fp.GangVerdict) -> None:
        """Pods not all running yet: say what they wait for; fail at the startup deadline."""
        rp = self.spec.run_policy
        if self.queued:
            self.waiting_in_queue()
            return
        admitted = c.get_condition(self.st.conditions, queueing.ADMITTED)
        admitted_at = parse_time(admitted.last_transition_time) if admitted and admitted.status == "True" else None
        start, since = deadlines.startup_since(parse_time(self.st.launch_time) or self.now, admitted_at)
        left = deadlines.startup_left(start, rp.startup_deadline_seconds, self.now)
        why = explain_waiting(self.spec, verdict.stuck_reason, verdict.stuck_message)
        if left <= 0:
            self.fail(c.REASON_STARTUP_DEADLINE, f"pods not all running {rp.startup_deadline_seconds}s after "
                      f"{since} (runPolicy.startupDeadlineSeconds){': ' + why if why else ''}")
            return
        if self.st.phase == Phase.PENDING:
            if why:
                if self.reason_changed_to(verdict.stuck_reason):
                    self.event("Warning", verdict.stuck_reason, why)
                self.set_phase(Phase.PENDING, verdict.stuck_reason, f"waiting: {why}")
            else:
                self.set_phase(Phase.PENDING, c.REASON_PODS_STARTING, "waiting for every pod to run")
        self.requeue(min(left, STARTING_POLL_S))

    def waiting_in_queue(self) -> None:
        """Gated by Kueue: no startup deadline runs (it starts at admission, since waiting
        for quota held by other teams is not a failure to start), and the job says so."""
        message = c.get_condition(self.st.conditions, queueing.ADMITTED).message  # type: ignore[union-attr]  # queued: track_admission set it
        if self.st.phase == Phase.PENDING:
            if self.reason_changed_to(queueing.REASON_QUEUED):
                self.event("Normal", queueing.REASON_QUEUED, message)
            self.set_phase(Phase.PENDING, queueing.REASON_QUEUED, message)
        self.requeue(STARTING_POLL_S)

    def attempt_failed(self, verdict: fp.GangVerdict, current: dict[int, dict[str, Any]],
                       reason: str | None = None) -> None:
        """A failed attempt: restart the gang, or fail the job when backoffLimit is spent."""
        rp = self.spec.run_policy
        failures = self.st.restarts.failures
        if failures >= rp.backoff_limit:
            self.fail(verdict.reason or c.REASON_BACKOFF_LIMIT,
                      f"{c.REASON_BACKOFF_LIMIT}: {failures + 1} failed attempts "
                      f"(runPolicy.backoffLimit {rp.backoff_limit}); last: {verdict.message}")
        else:
            self.restart(RestartCause.FAILURE, verdict, current, reason)

    def watchdog(self, current: dict[int, dict[str, Any]]) -> None:
        """Restart a gang whose step stopped advancing (a rank stuck in a collective, say);
        when the watchdog is armed: deadlines.py."""
        limit = self.spec.run_policy.progress_deadline_seconds
        progress = self.st.progress
        left = deadlines.progress_left(limit, parse_time(progress.last_step_time), parse_time(self.st.launch_time),
                                       progress.step, progress.total_steps, self.now, self.observing_since)
        if left is None:
            return
        if left > 0:
            self.requeue(left)
            return
        verdict = fp.GangVerdict(fp.Verdict.RESTART_FAILED, c.REASON_PROGRESS_DEADLINE,
                                 f"step {progress.step} has not advanced for {limit}s "
                                 "(runPolicy.progressDeadlineSeconds); a rank may be stuck")
        self.attempt_failed(verdict, current, reason=c.REASON_PROGRESS_DEADLINE)

    def restart(self, cause: RestartCause, verdict: fp.GangVerdict, current: dict[int, dict[str, Any]],
                reason: str | None = None) -> None:
        delay = fp.restart_delay(self.spec.run_policy.restart_backoff_seconds, self.st.restarts.total)
        self.st.restarts.count(cause)
        self.st.attempt += 1
        self.st.restart_after = iso(self.now + timedelta(seconds=delay))
        reason = reason or (c.REASON_RESTART_FAILURE if cause == RestartCause.FAILURE else c.REASON_RESTART_PREEMPTION)
        message = (f"{verdict.reason}: {verdict.message}; restarting the whole gang in {delay:.0f}s "
                   f"(attempt {self.st.attempt})")
        self.set_phase(Phase.RESTARTING, reason, message)
        self.event("Warning", reason, message)
        self.plan.restart_cause = cause
        self.stop(list(current.values()), finished_too=True)
        self.requeue(max(delay, STALE_POLL_S))

    def finish(self) -> Plan:
        if dump(self.st) != dump(self.old):
            self.plan.new_status = self.st
        return self.plan


def plan(body: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None = None,
         node_ready: dict[str, fp.NodeReadiness] | None = None, metrics: dict[str, float] | None = None,
         rejection: Rejection | None = None, node_leases: dict[str, fp.NodeLease] | None = None,
         observing_since: datetime | None = None, cluster_nodes: list[dict[str, Any]] | None = None) -> Plan:
    """Decide what to do for one SFTJob given its pods (see module docstring). `node_ready`:
    the Ready condition of the nodes of pending and running pods. `rejection`: the API server
    refused to create a pod of the current attempt.
    `node_leases`: the heartbeats of the nodes of running pods, read when a rank has failed
    (failure_policy.settle_generic_failure). `observing_since`: when this operator process
    began watching (deadlines.progress_left). `cluster_nodes`: the Nodes, read for a job
    that may change size (elastic.py); None: not read."""
    return _Pass(body, pods, now or datetime.now(UTC), node_ready, metrics, rejection, node_leases,
                 observing_since, cluster_nodes).run()
