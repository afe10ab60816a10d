"""SFTJobs under the real Kueue (v0.17, pod-group integration) on the local cluster, with
real training: all-or-nothing admission against a ClusterQueue that fits one job, and
priority preemption that the preempted job survives as a preemption, resuming from its
checkpoint to the same weights as an undisturbed run.

Kueue is started by the `kueue` fixture (built into the cache on first use) and manages only
the namespaces labelled for it, so the other suites never meet its webhook."""
from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import datetime, UTC

import pytest

from hack.localcluster import kueue as lk
from hack.localcluster.kube import ApiError
from sftjob_operator import queueing
from hack.localcluster.logtap import LogTap
from tests.fixtures.cluster import wait_for

from .cluster_kit import RESUMABLE, apply, condition, diagnose, example, get_job, phase_is, pods_of, wait_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
KUEUE_API = "/apis/kueue.x-k8s.io/v1beta2"
LOW, HIGH = "sftjob-test-low", "sftjob-test-high"
# Short runs without validation; LoRA merged into hf/final, as in the example.
SHORT = {**RESUMABLE, "training.totalTrainingSteps": 20}


@pytest.fixture(scope="module")
def kueue(cluster):
    lk.kueue_up(cluster.cfg)
    for name, value in ((LOW, 100), (HIGH, 1000)):
        try:
            cluster.kube.create("/apis/scheduling.k8s.io/v1/priorityclasses", {
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                "value": value, "preemptionPolicy": "Never"})
        except ApiError as e:
            if e.status != 409:
                raise
    return cluster.cfg


@pytest.fixture
def queue(cluster, kueue, example_ns):
    """A ClusterQueue with room for exactly one example job (2 pods x cpu 1, memory 4Gi),
    lower priorities preempted, and the LocalQueue `team` in the test's namespace."""
    ns = example_ns
    lk.enable_namespace(ns, kueue)
    cq = f"cq-{uuid.uuid4().hex[:8]}"
    cluster.kube.create(f"{KUEUE_API}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2",
                        "kind": "ResourceFlavor", "metadata": {"name": cq}})
    cluster.kube.create(f"{KUEUE_API}/clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                 "preemption": {"withinClusterQueue": "LowerPriority"},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
                     {"name": cq, "resources": [{"name": "cpu", "nominalQuota": "2"},
                                                {"name": "memory", "nominalQuota": "8Gi"}]}]}]}})
    cluster.kube.create(f"{KUEUE_API}/namespaces/{ns}/localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": cq}})
    wait_for(lambda: condition(cluster.kube.get(f"{KUEUE_API}/namespaces/{ns}/localqueues/team"), "Active")
             ["status"] == "True", 60, what="LocalQueue active")
    yield "team"
    for path in (f"{KUEUE_API}/namespaces/{ns}/localqueues/team", f"{KUEUE_API}/clusterqueues/{cq}",
                 f"{KUEUE_API}/resourceflavors/{cq}"):
        try:
            cluster.kube.delete(path)
        except ApiError:
            pass


def kueue_state(cluster, ns: str) -> str:
    """Pods' Kueue labels and gates, and the Workloads' conditions: what a failure needs."""
    lines = []
    for p in cluster.kube.get(f"/api/v1/namespaces/{ns}/pods")["items"]:
        m = p["metadata"]
        lines.append(f"pod {m['name']} {p.get('status', {}).get('phase')} node={p['spec'].get('nodeName')} "
                     f"gates={queueing.kueue_gates(p)} group={queueing.group_of(p)} managed={queueing.managed(p)} "
                     f"deleting={bool(m.get('deletionTimestamp'))} finalizers={m.get('finalizers')}")
    for w in cluster.kube.get(f"{KUEUE_API}/namespaces/{ns}/workloads")["items"]:
        conds = [(c["type"], c["status"], c["reason"], c.get("message", "")[:200])
                 for c in w.get("status", {}).get("conditions", [])]
        lines.append(f"workload {w['metadata']['name']}: {conds}")
    return "\n".join(lines)


def queued(name: str, queue: str, **overrides):
    obj = example(name, **overrides)
    obj["metadata"]["labels"] = {queueing.QUEUE_LABEL: queue}
    return obj


UNGATE_WINDOW_S = 5.0


def gated(pod) -> bool:
    return bool(queueing.kueue_gates(pod))


class Sampler(threading.Thread):
    """Samples the pods of some jobs (and the jobs) to check gang invariants afterwards."""

    def __init__(self, cluster, ns, names):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.names = cluster, ns, names
        self.samples: list[tuple[float, dict[str, list], dict[str, dict]]] = []
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            try:
                pods = {n: pods_of(self.cluster, self.ns, n) for n in self.names}
                jobs = {n: self.status(n) for n in self.names}
                self.samples.append((time.time(), pods, jobs))
            except Exception:  # noqa: BLE001 - a sample lost to an API hiccup is fine
                pass
            self.stopped.wait(0.2)

    def status(self, name):
        try:
            return get_job(self.cluster, self.ns, name).get("status", {})
        except ApiError as e:
            if e.status == 404:   # not applied yet
                return {}
            raise

    def stop(self):
        self.stopped.set()
        self.join(10)

    def first(self, pred) -> float | None:
        return next((t for t, pods, jobs in self.samples if pred(pods, jobs)), None)

    def check_gangs(self):
        """Never one pod of a gang placed (scheduled or running) while its peer stays gated;
        never two gangs holding the quota of one. Kueue lifts an admitted group's gates with one
        request per pod, and the scheduler may bind the first pod before the second request
        lands (seen in a cold CI run, 2 s into the job), so a peer may show its gate for a moment
        after the first pod is placed: up to UNGATE_WINDOW_S, never longer. A gang admitted by
        halves keeps its peer gated until quota frees: tens of seconds."""
        since: dict[str, float] = {}   # job -> first sample of the current placed-with-gated-peer run
        for t, pods, _ in self.samples:
            holding = []
            for name, ps in pods.items():
                live = [p for p in ps if not p["metadata"].get("deletionTimestamp")
                        and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
                placed = [p for p in live if p["spec"].get("nodeName")]
                if placed and any(gated(p) for p in live):
                    start = since.setdefault(name, t)
                    if t - start > UNGATE_WINDOW_S:
                        raise AssertionError(f"{name}: a pod placed while its peer stayed gated from {start} to {t}")
                else:
                    since.pop(name, None)
                if placed:
                    holding.append(name)
            assert len(holding) <= 1, f"two gangs hold the quota of one at {t}: {holding}"


def _pod(node: str | None, gate: bool) -> dict:
    gates = [{"name": queueing.GATE_PREFIX + "admission"}] if gate else []
    return {"metadata": {}, "spec": {"nodeName": node, "schedulingGates": gates}, "status": {"phase": "Pending"}}


def test_check_gangs_allows_the_ungating_moment_and_refuses_a_peer_left_gated():
    """The checker itself, on made-up samples 0.2 s apart (no cluster)."""
    def sampler(gated_for: float) -> Sampler:
        rec = Sampler(None, "ns", ["j"])
        steps = int(gated_for / 0.2)
        rec.samples = ([(i * 0.2, {"j": [_pod(None, True), _pod(None, True)]}, {}) for i in range(3)]
                       + [(1 + i * 0.2, {"j": [_pod("n0", False), _pod(None, True)]}, {}) for i in range(steps)]
                       + [(60.0, {"j": [_pod("n0", False), _pod("n1", False)]}, {})])
        return rec

    sampler(0.4).check_gangs()
    sampler(UNGATE_WINDOW_S - 1).check_gangs()
    with pytest.raises(AssertionError, match="stayed gated"):
        sampler(UNGATE_WINDOW_S + 2).check_gangs()


def ungated(name):
    """Every pod of the job's current attempt exists, none is gated."""
    def pred(pods, jobs):
        ps = [p for p in pods[name] if not p["metadata"].get("deletionTimestamp")]
        return len(ps) == 2 and not any(gated(p) for p in ps)
    return pred


def test_second_job_waits_gated_until_the_first_finishes(cluster, scoped_operator, example_ns, queue):
    ns, op = example_ns, scoped_operator
    rec = Sampler(cluster, ns, ["first", "second"])
    rec.start()
    t_apply = time.time()
    apply(cluster, ns, queued("first", queue, **SHORT))
    try:
        first_ok = wait_for(lambda: rec.first(ungated("first")), 60, interval=0.2, what="first admitted")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{kueue_state(cluster, ns)}\n{diagnose(cluster, ns, 'first', op)}") from None
    apply(cluster, ns, queued("second", queue, **SHORT))
    try:
        # The second is queued: its pods exist, gated, and its status says so.
        job = wait_job(cluster, ns, "second", op, lambda j: j if (condition(j, "Ready") or {}).get("reason")
                       == queueing.REASON_QUEUED else None, timeout=60, what="second queued")
        assert job["status"]["phase"] == "Pending"
        assert "LocalQueue team" in job["status"]["message"]
        adm = condition(job, queueing.ADMITTED)
        assert adm["status"] == "False" and adm["reason"] == queueing.REASON_WAITING
        pods = pods_of(cluster, ns, "second")
        assert len(pods) == 2 and all(gated(p) and not p["spec"].get("nodeName") for p in pods)
        assert all(p["metadata"]["labels"][queueing.GROUP_LABEL].endswith("-a0") for p in pods)
        out = cluster.kubectl("-n", ns, "get", "sft", "second", "--no-headers").stdout
        assert "Pending" in out, out
        first = wait_job(cluster, ns, "first", op, phase_is("Succeeded", "Failed"), timeout=300, what="first done")
        assert first["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "first", op)
        # Still gated while the first ran; admitted once its quota was released.
        second = wait_job(cluster, ns, "second", op, phase_is("Succeeded", "Failed"), timeout=300,
                          what="second done")
        assert second["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "second", op)
    finally:
        rec.stop()
    rec.check_gangs()
    first_done = rec.first(lambda pods, jobs: jobs["first"].get("phase") == "Succeeded")
    second_ok = rec.first(ungated("second"))
    assert second_ok and first_done and second_ok >= first_done - 1.0, (second_ok, first_done)
    adm = condition(second, queueing.ADMITTED)
    assert adm["status"] == "True" and adm["reason"] == queueing.REASON_ADMITTED
    assert second["status"]["restarts"] == {"failures": 0, "preemptions": 0, "total": 0}
    created = rec.first(lambda pods, jobs: len(pods["first"]) == 2)
    print(f"pods created {created - t_apply:.2f}s after apply; "
          f"admission latency (apply -> pods ungated), free quota: {first_ok - t_apply:.2f}s; "
          f"second admitted {second_ok - first_done:.2f}s after the first was seen Succeeded")


def _resume(log: str) -> tuple[int, int, float]:
    """From rank 0's log (all attempts, one file): the step checkpointed on SIGTERM, the step
    the next gang resumed from, and when it logged its first step (epoch seconds). Fails if a
    step after the resume is not the next one (a step trained twice, or skipped)."""
    lines = log.splitlines()
    stop = next(i for i, line in enumerate(lines) if "stopped after SIGTERM: checkpoint step-" in line)
    saved = int(re.search(r"checkpoint step-(\d+) committed", lines[stop]).group(1))
    res = next(i for i, line in enumerate(lines) if i > stop and "resumed from" in line)
    resumed = int(re.search(r"/step-(\d+)\b", lines[res]).group(1))
    steps = [(int(m.group(1)), line[:8]) for line in lines[res:] if (m := re.search(r" step (\d+)/\d+ loss", line))]
    assert [n for n, _ in steps] == list(range(resumed + 1, resumed + 1 + len(steps))), steps
    day = datetime.now(UTC).date()
    hms = datetime.strptime(steps[0][1], "%H:%M:%S").time()
    return saved, resumed, datetime.combine(day, hms, tzinfo=UTC).timestamp()


def _weights(cluster, uri: str) -> dict:
    import safetensors.torch

    bucket, key = uri[len("s3://"):].split("/", 1)
    s3 = cluster.s3()
    out = {}
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=key + "/")["Contents"]:
        if obj["Key"].endswith(".safetensors"):
            data = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out.update(safetensors.torch.load(data))
    assert out, f"no safetensors under {uri}"
    return out


def test_higher_priority_preempts_lower_which_resumes_to_the_same_weights(
        cluster, scoped_operator, example_ns, queue, tmp_path):
    ns, op = example_ns, scoped_operator
    spec = {**RESUMABLE, "training.totalTrainingSteps": 120, "resources.priorityClassName": LOW,
            "runPolicy.restartBackoffSeconds": 1}
    rec = Sampler(cluster, ns, ["low", "high"])
    rec.start()
    # a kubelet forgets a deleted pod's log: keep both of rank 0's incarnations (before and
    # after the eviction) in one file
    tap = LogTap(cluster.kube, ns, "sftjob.io/job-name=low", tmp_path / "logs").start()
    apply(cluster, ns, queued("low", queue, **spec))
    # The same job alone, outside any queue: the weights to match.
    apply(cluster, ns, example("alone", **spec))
    try:
        job = wait_job(cluster, ns, "low", op, lambda j: j if j.get("status", {}).get("progress", {})
                       .get("lastCheckpointStep", 0) >= 10 else None, timeout=300, what="low checkpointed")
        ckpt = job["status"]["progress"]["lastCheckpointStep"]
        apply(cluster, ns, queued("high", queue, **{**SHORT, "resources.priorityClassName": HIGH}))
        t_high = time.time()
        job = wait_job(cluster, ns, "low", op, lambda j: j if j.get("status", {}).get("restarts", {})
                       .get("preemptions") == 1 else None, timeout=120, what="low preempted")
        assert job["status"]["restarts"]["failures"] == 0
        # Judged from Kueue's TerminationTarget condition on the pods (reason WorkloadEvicted).
        restart_message = job["status"]["message"]
        assert "WorkloadEvicted" in restart_message, restart_message
        high = wait_job(cluster, ns, "high", op, phase_is("Succeeded", "Failed"), timeout=300, what="high done")
        assert high["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "high", op)
        low = wait_job(cluster, ns, "low", op, phase_is("Succeeded", "Failed"), timeout=400, what="low done")
        assert low["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "low", op)
        alone = wait_job(cluster, ns, "alone", op, phase_is("Succeeded", "Failed"), timeout=300, what="alone")
        assert alone["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "alone", op)
    finally:
        rec.stop()
    rec.check_gangs()
    assert low["status"]["restarts"] == {"failures": 0, "preemptions": 1, "total": 1}
    print(f"low's restart: {restart_message}")
    # Kueue's eviction: it marks the attempt-0 pods TerminationTarget and deletes them.
    evicted = rec.first(lambda pods, jobs: any(
        p["metadata"].get("deletionTimestamp") or queueing.termination_target(p) for p in pods["low"]
        if p["metadata"]["labels"].get(queueing.GROUP_LABEL, "").endswith("-a0")))
    assert evicted, "the sampler never saw low's first gang being evicted"
    # The new gang was a new pod group that waited, gated, while the high job ran.
    regated = rec.first(lambda pods, jobs: any(gated(p) and p["metadata"]["labels"][queueing.GROUP_LABEL]
                                               .endswith("-a1") for p in pods["low"]))
    assert regated, "the restarted low gang was never queued"
    # Resumed from the checkpoint committed on Kueue's SIGTERM: no step trained twice.
    tap.stop()
    log = tap.path("low-node-0", "trainer").read_text(errors="replace")
    # The trainer image carries tcmalloc: the launcher preloads it and the trainer runs on it.
    said = [line for line in log.splitlines() if "memory allocator: tcmalloc" in line]
    assert any("sftjob launch:" in line for line in said), said           # the launcher preloaded it
    assert any("sftjob launch:" not in line for line in said), said       # the trainer has it mapped
    saved, resumed, first_step_at = _resume(log)
    assert resumed == saved, (saved, resumed)
    after = [s["low"].get("progress", {}).get("step") for _, _, s in rec.samples
             if s["low"].get("attempt", 0) >= 1 and s["low"].get("phase") == "Running"]
    assert all(step is None or step >= ckpt for step in after), (ckpt, after)
    # eviction -> first step of the resumed gang (high ran in between), and readmission.
    high_done = rec.first(lambda pods, jobs: jobs["high"].get("phase") == "Succeeded")
    readmitted = rec.first(lambda pods, jobs: jobs["low"].get("attempt", 0) >= 1 and any(
        p["metadata"]["labels"].get(queueing.GROUP_LABEL, "").endswith("-a1") and not gated(p)
        for p in pods["low"]))
    print(f"high applied -> low evicted: {evicted - t_high:.2f}s; high done -> low readmitted: "
          f"{(readmitted or 0) - (high_done or 0):.2f}s; eviction -> resumed gang's first step {saved + 1} "
          f"(rank 0's log, 1 s resolution): {first_step_at - evicted:.0f}s, of which the high job held the "
          f"quota {(high_done or 0) - evicted:.0f}s and readmission -> first step took "
          f"{first_step_at - (readmitted or 0):.0f}s")
    # The preempted run ends with exactly the weights of the undisturbed one.
    a, b = _weights(cluster, low["status"]["output"]["uri"]), _weights(cluster, alone["status"]["output"]["uri"])
    assert a.keys() == b.keys()
    diff = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all())]
    assert not diff, f"weights differ from the undisturbed run: {diff[:5]}"


def test_suspend_releases_the_quota_and_resume_queues_again(cluster, scoped_operator, example_ns, queue):
    ns, op = example_ns, scoped_operator
    apply(cluster, ns, queued("holder", queue, **SHORT))
    wait_job(cluster, ns, "holder", op, phase_is("Running"), timeout=120, what="holder running")
    apply(cluster, ns, queued("waiter", queue, **SHORT))
    wait_job(cluster, ns, "waiter", op, lambda j: j if (condition(j, "Ready") or {}).get("reason")
             == queueing.REASON_QUEUED else None, timeout=60, what="waiter queued")
    holder = get_job(cluster, ns, "holder")
    group = queueing.group_name("holder", holder["metadata"]["uid"], holder["status"]["attempt"])
    t_suspend = time.time()
    cluster.kubectl("-n", ns, "patch", "sft", "holder", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    # The holder's pods are deleted, its Workload finishes, and the waiter gets the quota.
    wait_for(lambda: len(pods_of(cluster, ns, "waiter")) == 2 and not any(gated(p) for p in pods_of(
        cluster, ns, "waiter")), 120, what=f"waiter admitted after the suspend\n{kueue_state(cluster, ns)}")
    released = time.time() - t_suspend
    holder = get_job(cluster, ns, "holder")
    assert holder["status"]["phase"] == "Suspended"
    adm = condition(holder, queueing.ADMITTED)
    assert adm["status"] == "False" and "releases its quota" in adm["message"], adm
    try:
        wl = cluster.kube.get(f"{KUEUE_API}/namespaces/{ns}/workloads/{group}")
        assert (condition(wl, "Finished") or {}).get("status") == "True", wl.get("status")
    except ApiError as e:
        assert e.status == 404
    # Resumed: a new pod group, queued behind the waiter that now holds the quota.
    cluster.kubectl("-n", ns, "patch", "sft", "holder", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    job = wait_job(cluster, ns, "holder", op, lambda j: j if (condition(j, "Ready") or {}).get("reason")
                   == queueing.REASON_QUEUED else None, timeout=120, what="holder queued again")
    pods = pods_of(cluster, ns, "holder")
    assert pods and all(gated(p) for p in pods), kueue_state(cluster, ns)
    assert {queueing.group_of(p) for p in pods} == {queueing.group_name("holder", job["metadata"]["uid"],
                                                                        job["status"]["attempt"])} != {group}
    print(f"suspend -> the waiting job's pods ungated: {released:.2f}s")
