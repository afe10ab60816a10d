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
the progress watchdog.

This module sequences the stages of a pass; each policy is a pure, table-tested module that
decides and applies its rule against the pass's interface (jobpass.Pass): suspend, deadlines,
stale, rejections, queueing (Kueue), elastic, restarts, success, ttl, edits, and
failure_policy, which judges the gang. The policies that act while a gang starts, runs or is
about to be built are listed once, in POLICIES; adding one is a module and a line there.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, UTC
from types import ModuleType
from typing import Any

from sftjob_contract import layout

from . import builders, deadlines, edits, elastic, eta, failure_policy as fp
from . import conditions as c
from . import progress as prog
from . import queueing, rejections, restarts, stale, stop_request, success, suspend, ttl
from .jobpass import PROGRESS_INTERVAL_S, SETTLE_POLL_S, STALE_POLL_S, STARTING_POLL_S, Gang, Pass
from .nodes import NodeLease, NodeReadiness
from .phases import TERMINAL, Phase
from .plan import Event, Plan
from .rejections import Rejection
from .status import dump, fields_patch, iso, parse, parse_time

__all__ = ["PROGRESS_INTERVAL_S", "POLICIES", "plan"]

# The policies with a say in a gang's stages, in order (jobpass.py: on_new_gang,
# while_starting, while_running; the first that acts ends the stage).
POLICIES: tuple[ModuleType, ...] = (elastic, queueing, rejections, deadlines)


def _hooks(stage: str) -> list[Callable[..., Any]]:
    return [getattr(m, stage) for m in POLICIES if hasattr(m, stage)]


class _Pass:
    """One reconcile pass over one job; builds a Plan."""

    def __init__(self, body: dict[str, Any], pods: list[dict[str, Any]], now: datetime,
                 node_ready: dict[str, NodeReadiness] | None, metrics: dict[str, float] | None,
                 rejection: Rejection | None = None, node_leases: dict[str, NodeLease] | None = None,
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
        # Checked before anything else waits: a gang stuck terminating ends at the deadline too.
        if deadlines.active(self):
            return
        if old_gang:
            # An earlier gang still exists (or is still checkpointing): let it go first.
            stale.wait(self, old_gang)
            return
        restart_after = parse_time(self.st.restart_after)
        if restart_after and self.now < restart_after:
            self.requeue((restart_after - self.now).total_seconds())
            return
        if self.st.launched_attempt != attempt:
            if self.rejection is not None:
                rejections.apply(self, self.rejection, current)
                return
            if not current:
                for hook in _hooks("on_new_gang"):
                    hook(self)
            if len(current) < self.size:
                self.launch(attempt, current)
                return
            # Every rank exists but the launch was never recorded: adopt the gang.
            self.st.launched_attempt = attempt
            created = [p["metadata"].get("creationTimestamp") for p in current.values()]
            self.st.launch_time = max([t for t in created if t] or [iso(self.now)])
        self.judge(attempt, current)

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
            queueing.set_admitted(self, False, queueing.REASON_WAITING,
                                  queueing.queued_message(queueing.queue_name(self.meta), name, []))
        self.st.output.uri = builders.model_uri(self.job, self.spec)   # what this gang will write
        self.plan.launched_status = fields_patch(launched_attempt=attempt, launch_time=iso(self.now),
                                                 launched_generation=self.generation,
                                                 launched_spec=edits.fingerprint(self.spec))
        self.requeue(STARTING_POLL_S)

    def judge(self, attempt: int, current: dict[int, dict[str, Any]]) -> None:
        nodes = self.size
        self.queued = queueing.track_admission(self, current)
        outcomes: dict[int, fp.PodOutcome | None] = {r: fp.classify_pod(p, fp.node_ready_for(
                        p, self.node_ready.get((p.get("spec") or {}).get("nodeName", ""))))
                    for r, p in current.items()}
        outcomes, settle_s = fp.settle_generic_failure(outcomes, current, self.node_leases, self.now)
        verdict = fp.judge_gang(outcomes, nodes)
        if verdict.verdict is fp.Verdict.RESTART_FAILED and settle_s > 0:
            # a peer's node has not shown a heartbeat since: a failure, or a dead machine's echo?
            self.requeue(min(settle_s, SETTLE_POLL_S))
            return
        ON_VERDICT[verdict.verdict](self, verdict, current)

    def finish(self) -> Plan:
        if dump(self.st) != dump(self.old):
            self.plan.new_status = self.st
        return self.plan


def _starting(p: Pass, verdict: fp.GangVerdict, current: Gang) -> None:
    """Pods not all running yet: the policies, in order, until one acts."""
    any(hook(p, verdict, current) for hook in _hooks("while_starting"))


def _running(p: Pass, verdict: fp.GangVerdict, current: Gang) -> None:
    """Every pod runs: the job is Running, its progress is read, then the policies, in order,
    until one acts."""
    nodes, attempt = p.size, p.st.attempt
    if p.st.phase != Phase.RUNNING:
        p.set_phase(Phase.RUNNING, c.REASON_ALL_RUNNING, f"all {nodes} pods running (attempt {attempt})")
        p.event("Normal", c.REASON_ALL_RUNNING, f"all {nodes} pods running (attempt {attempt})")
    p.st.start_time = p.st.start_time or iso(p.now)
    if p.metrics:
        p.st.progress = eta.update(p.st.progress, prog.merge(p.st.progress, p.metrics, iso(p.now)), p.st.attempt,
                                   p.now, parse_time(p.meta.get("creationTimestamp")))
    p.requeue(PROGRESS_INTERVAL_S)
    any(hook(p, verdict, current) for hook in _hooks("while_running"))


# What a gang's verdict (failure_policy.judge_gang) leads to.
ON_VERDICT: dict[fp.Verdict, Callable[[Pass, fp.GangVerdict, Gang], None]] = {
    fp.Verdict.FAILED: restarts.failed,
    fp.Verdict.SUCCEEDED: success.apply,
    fp.Verdict.RESTART_FAILED: restarts.after_failure,
    fp.Verdict.RESTART_PREEMPTED: restarts.after_preemption,
    fp.Verdict.STARTING: _starting,
    fp.Verdict.RUNNING: _running,
}
_CONFORMS: type[Pass] = _Pass   # mypy: the pass implements the interface the policies see


def plan(body: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None = None,
         node_ready: dict[str, NodeReadiness] | None = None, metrics: dict[str, float] | None = None,
         rejection: Rejection | None = None, node_leases: dict[str, NodeLease] | None = None,
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
