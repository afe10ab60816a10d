"""No job is left in a state that needs a human: each case below once waited forever, was
charged to the wrong budget, or pointed at an output that does not exist."""
from __future__ import annotations

import pytest
from .op_testkit import apply, at, cond, job_body, pods_for, running_job, terminated

from sftjob_operator import builders, reconcile, rejections
from sftjob_operator.nodes import NodeReadiness
from sftjob_operator.status import iso

pytestmark = pytest.mark.unit


def test_gang_whose_launch_record_was_lost_is_adopted_and_judged():
    """The operator died (or the status write failed) after the last pod was created but
    before launchedAttempt was written: the gang must still be judged."""
    body = job_body()
    body = apply(body, reconcile.plan(body, [], at(0)))
    body["status"].pop("launchedAttempt")
    body["status"].pop("launchTime")
    pods = pods_for(body)
    for p in pods:
        p["metadata"]["creationTimestamp"] = "2026-01-01T12:00:01Z"
    plan = reconcile.plan(body, pods, at(5))
    assert not plan.launch
    assert plan.status["launchedAttempt"] == 0 and plan.status["launchTime"] == "2026-01-01T12:00:01Z"
    assert plan.status["phase"] == "Running"
    body = apply(body, plan)
    plan = reconcile.plan(body, [terminated(pods[0], 1, "TrainingError: boom"), pods[1]], at(9))
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"]["failures"] == 1


def test_old_pod_stuck_terminating_on_lost_node_is_force_deleted():
    body, pods = running_job(**{"runPolicy.activeDeadlineSeconds": 300})
    body = apply(body, reconcile.plan(body, pods[:1], at(30)))  # rank 1 lost: restart
    old = pods[:1]
    old[0]["metadata"]["deletionTimestamp"] = "2026-01-01T12:01:10Z"  # grace 40 s from 12:00:30
    ready = {"node-0": NodeReadiness(False)}
    # No kubelet on a lost node can honour the grace period: forced at once, within it too
    # (fencing keeps a trainer still running there off the output).
    plan = reconcile.plan(body, old, at(60), node_ready=ready)
    assert plan.force_delete_pods == ["tiny-node-0"]
    assert [e.reason for e in plan.events] == ["ForceDeletedPod"]
    # A ready node's kubelet finishes the termination itself: never forced, and waited for.
    for t in (60, 101):
        assert not reconcile.plan(body, old, at(t), node_ready={"node-0": NodeReadiness(True)}).force_delete_pods
    # The active deadline still fires while an old pod hangs on.
    plan = reconcile.plan(body, old, at(400), node_ready={"node-0": NodeReadiness(True)})
    assert plan.status["phase"] == "Failed" and cond(plan.status, "Failed")["reason"] == "DeadlineExceeded"


def test_exit_2_fails_at_once_without_spending_backoff():
    body, pods = running_job(**{"runPolicy.backoffLimit": 3})
    plan = reconcile.plan(body, [terminated(pods[0], 2, "InvalidData: column 'prompt' missing"), pods[1]], at(30))
    st = plan.status
    assert st["phase"] == "Failed" and st["restarts"]["failures"] == 0
    failed = cond(st, "Failed")
    assert failed["reason"] == "InvalidData" and "column 'prompt' missing" in failed["message"]
    assert plan.delete_pods == ["tiny-node-1"]


def test_peer_failing_after_its_partner_was_evicted_is_one_preemption():
    body, pods = running_job()
    evicted = terminated(pods[0], 143, "Preempted: checkpoint step-7 committed")
    evicted["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]
    peer = terminated(pods[1], 1, "TrainingError: connection reset by peer")
    plan = reconcile.plan(body, [evicted, peer], at(30))
    assert plan.status["restarts"] == {"failures": 0, "preemptions": 1, "total": 1}
    assert plan.restart_cause == "preemption"


def test_lora_without_merge_reports_the_adapter_as_output():
    body, pods = running_job(**{"output.mergeLora": False})
    plan = reconcile.plan(body, [terminated(p, 0) for p in pods], at(30))
    assert plan.status["output"]["uri"].endswith("/hf/adapter")
    body, pods = running_job(**{"training.lora.rank": 0, "output.mergeLora": False})
    plan = reconcile.plan(body, [terminated(p, 0) for p in pods], at(30))
    assert plan.status["output"]["uri"].endswith("/hf/final")  # a full fine-tune has no adapter


def test_watchdog_restarts_a_gang_whose_step_stopped_as_a_failure():
    body, pods = running_job(**{"runPolicy.progressDeadlineSeconds": 120})
    m = {"step": 3, "totalSteps": 20}
    body = apply(body, reconcile.plan(body, pods, at(10), metrics=m))
    assert body["status"]["progress"]["lastStepTime"] == "2026-01-01T12:00:10Z"
    plan = reconcile.plan(body, pods, at(100), metrics=m)
    assert plan.status is None and plan.requeue_after <= 30
    plan = reconcile.plan(body, pods, at(131), metrics=m)
    st = plan.status
    assert st["phase"] == "Restarting" and st["restarts"]["failures"] == 1 and plan.restart_cause == "failure"
    assert cond(st, "Restarting")["reason"] == "ProgressDeadlineExceeded"
    assert [e.reason for e in plan.events] == ["ProgressDeadlineExceeded"]
    assert sorted(plan.delete_pods) == ["tiny-node-0", "tiny-node-1"]


def test_an_operator_outage_longer_than_the_deadline_restarts_no_healthy_gang():
    """The operator was down from 12:00:20 to 12:10:00 (deadline 120 s). Its first pass has
    no reading yet: the step time stored before the outage must not condemn the gang."""
    body, pods = running_job(**{"runPolicy.progressDeadlineSeconds": 120})
    m = {"step": 3, "totalSteps": 20}
    body = apply(body, reconcile.plan(body, pods, at(10), metrics=m))
    back = at(600)
    plan = reconcile.plan(body, pods, back, observing_since=back)
    assert plan.status is None and not plan.delete_pods and 0 < plan.requeue_after <= 120
    # The first reading shows the gang trained on while nobody watched: it stays Running.
    body = apply(body, reconcile.plan(body, pods, at(605), metrics={"step": 60, "totalSteps": 200},
                                      observing_since=back))
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"]["failures"] == 0
    # A gang that really stopped during the outage is still caught, a full deadline later.
    plan = reconcile.plan(body, pods, at(600 + 5 + 121), metrics={"step": 60, "totalSteps": 200},
                          observing_since=back)
    assert plan.status["phase"] == "Restarting" and cond(plan.status, "Restarting")["reason"] == \
        "ProgressDeadlineExceeded"


def test_watchdog_waits_for_the_first_step_and_spares_the_export():
    body, pods = running_job(**{"runPolicy.progressDeadlineSeconds": 120})
    # No step seen in this attempt yet (model load, data scan): no watchdog.
    assert reconcile.plan(body, pods, at(1000)).status is None
    done = {"step": 20, "totalSteps": 20}
    body = apply(body, reconcile.plan(body, pods, at(10), metrics=done))
    assert reconcile.plan(body, pods, at(1000), metrics=done).status is None  # exporting


def test_refused_pod_fails_the_job_naming_the_spec_field():
    body = job_body({"resources.tolerations": [{"key": "gpu", "operator": "Equal", "value": "x"}]})
    spec = builders.parse_spec(body["spec"])
    pod = builders.build_pod(builders.JobRef.from_body(body), spec, 0, 0)
    status = {"kind": "Status", "code": 422, "reason": "Invalid",
              "message": 'Pod "tiny-node-0" is invalid: spec.tolerations[0].effect: Unsupported value',
              "details": {"causes": [{"field": "spec.tolerations[0].effect", "message": "Unsupported value: \"X\""}]}}
    rej = rejections.from_api_error(422, status, pod, spec)
    plan = reconcile.plan(body, [], at(0), rejection=rej)
    failed = cond(plan.status, "Failed")
    assert plan.status["phase"] == "Failed" and failed["reason"] == "PodRejected"
    assert "spec.resources.tolerations[0].effect" in failed["message"]
    assert [e.reason for e in plan.events] == ["PodRejected"] and not plan.launch
    # Rank 0 was created before rank 1 was refused: it does not stay behind holding a node.
    body = apply(body, reconcile.plan(body, [], at(0)))
    for key in ("launchedAttempt", "launchTime"):  # the handler records them only if all pods exist
        body["status"].pop(key)
    plan = reconcile.plan(body, pods_for(body, phase="Pending")[:1], at(1), rejection=rej)
    assert plan.status["phase"] == "Failed" and plan.delete_pods == ["tiny-node-0"]


def test_quota_held_by_others_is_waited_for_then_the_startup_deadline_fails_it():
    body = job_body({"runPolicy.startupDeadlineSeconds": 60})
    body["metadata"]["creationTimestamp"] = "2026-01-01T12:00:00Z"
    spec = builders.parse_spec(body["spec"])
    pod = builders.build_pod(builders.JobRef.from_body(body), spec, 0, 0)
    msg = ('pods "tiny-node-0" is forbidden: exceeded quota: compute, requested: requests.cpu=2, '
           'used: requests.cpu=3, limited: requests.cpu=4')
    rej = rejections.from_api_error(403, {"message": msg}, pod, spec)
    assert not rej.permanent
    plan = reconcile.plan(body, [], at(5), rejection=rej)
    assert plan.status["phase"] == "Pending" and cond(plan.status, "Ready")["reason"] == "QuotaExceeded"
    assert [e.reason for e in plan.events] == ["QuotaExceeded"]
    body = apply(body, plan)
    assert not reconcile.plan(body, [], at(20), rejection=rej).events  # said once
    # Part of the gang got in before the quota ran out: it is retired (it would hold quota
    # while waiting for its peer), uncounted, and the whole gang is tried again later.
    first = pods_for(body, phase="Pending")[:1]
    plan = reconcile.plan(body, first, at(30), rejection=rej)
    assert plan.delete_pods == ["tiny-node-0"] and plan.status["attempt"] == 1
    assert plan.status["restarts"]["total"] == 0 and plan.status["restartAfter"] == "2026-01-01T12:00:40Z"
    body = apply(body, plan)
    assert reconcile.plan(body, [], at(41)).launch  # the next try, attempt 1
    # The startup deadline counts from when the job started waiting, across the retries.
    assert reconcile.plan(body, [], at(60), rejection=rej).status["phase"] == "Pending"
    plan = reconcile.plan(body, [], at(66), rejection=rej)
    assert plan.status["phase"] == "Failed" and "exceeded quota" in plan.status["message"]


def test_missing_secret_is_named_while_waiting_and_when_failing():
    body = job_body({"runPolicy.startupDeadlineSeconds": 60})
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body, phase="Pending")
    for p in pods:
        p["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "s3-credentials" not found'}}}]
    plan = reconcile.plan(body, pods, at(5))
    ready = cond(plan.status, "Ready")
    assert ready["reason"] == "CreateContainerConfigError"
    assert "spec.storage.credentialsSecretRef.name" in ready["message"] and "s3-credentials" in ready["message"]
    assert [e.reason for e in plan.events] == ["CreateContainerConfigError"]
    plan = reconcile.plan(apply(body, plan), pods, at(61))
    failed = cond(plan.status, "Failed")
    assert failed["reason"] == "StartupDeadlineExceeded"
    assert "spec.storage.credentialsSecretRef.name" in failed["message"]


def test_a_missing_tracking_secret_is_named_while_waiting():
    body = job_body({"tracking.wandb": {"project": "p", "apiKeySecret": "wandb-key"}})
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body, phase="Pending")
    for p in pods:
        p["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "wandb-key" not found'}}}]
    ready = cond(reconcile.plan(body, pods, at(5)).status, "Ready")
    assert "spec.tracking.wandb.apiKeySecret (wandb-key): CreateContainerConfigError" in ready["message"]


def test_image_that_is_not_on_the_node_is_named_while_waiting_and_when_failing():
    """A real kubelet with imagePullPolicy Never says ErrImageNeverPull: a stuck reason that names
    spec.resources.image, chosen over another rank's ordinary wait."""
    body = job_body({"runPolicy.startupDeadlineSeconds": 60, "resources.image": "registry.example/trainer:9",
                     "resources.imagePullPolicy": "Never"})
    body = apply(body, reconcile.plan(body, [], at(0)))
    pods = pods_for(body, phase="Pending")
    pods[0]["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}]
    pods[1]["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {
        "reason": "ErrImageNeverPull",
        "message": 'Container image "registry.example/trainer:9" is not present with pull policy of Never'}}}]
    plan = reconcile.plan(body, pods, at(5))
    ready = cond(plan.status, "Ready")
    assert ready["reason"] == "ErrImageNeverPull"
    assert "spec.resources.image (registry.example/trainer:9)" in ready["message"]
    assert "spec.resources.imagePullPolicy" in ready["message"]
    plan = reconcile.plan(apply(body, plan), pods, at(61))
    failed = cond(plan.status, "Failed")
    assert failed["reason"] == "StartupDeadlineExceeded"
    assert "ErrImageNeverPull" in failed["message"] and "spec.resources.image" in failed["message"]


@pytest.mark.parametrize("pod_field, expected", [
    ("spec.containers[0].resources.requests.memory", "spec.resources.memory"),
    ("spec.containers[0].resources.limits[memory]", "spec.resources.memory"),
    ("spec.containers[0].resources.requests[cpu]", "spec.resources.cpu"),
    ("spec.containers[0].image", "spec.resources.image"),
    ("spec.tolerations[1].operator", "spec.resources.tolerations[1].operator"),
    ("spec.nodeSelector", "spec.resources.nodeSelector"),
    ("spec.priorityClassName", "spec.resources.priorityClassName"),
    ("spec.containers[0].env[{mine}].name", "spec.resources.env[0].name (MY_VAR)"),
    ("spec.containers[0].env[0].name", "pod spec.containers[0].env[0].name"),
    ("metadata.labels", "pod metadata.labels"),
])
def test_pod_fields_map_back_to_spec_fields(pod_field, expected):
    body = job_body({"resources.env": [{"name": "MY_VAR", "value": "1"}]})
    spec = builders.parse_spec(body["spec"])
    pod = builders.build_pod(builders.JobRef.from_body(body), spec, 0, 0)
    mine = [e["name"] for e in pod["spec"]["containers"][0]["env"]].index("MY_VAR")
    assert rejections.spec_field(pod_field.format(mine=mine), pod, spec) == expected


@pytest.mark.parametrize("status, message, reason, permanent, field", [
    (403, 'pods "x" is forbidden: no PriorityClass with name urgent was found', "PodRejected", True,
     "spec.resources.priorityClassName"),
    (403, 'pods "x" is forbidden: error looking up service account ns/trainer: serviceaccount "trainer" not found',
     "PodRejected", True, "spec.resources.serviceAccountName"),
    (403, 'pods "x" is forbidden: exceeded quota: q, requested: limits.memory=64Gi, used: limits.memory=0, '
     'limited: limits.memory=32Gi', "QuotaExceeded", True, "spec.resources"),
])
def test_admission_refusals(status, message, reason, permanent, field):
    body = job_body()
    spec = builders.parse_spec(body["spec"])
    pod = builders.build_pod(builders.JobRef.from_body(body), spec, 0, 0)
    rej = rejections.from_api_error(status, {"message": message}, pod, spec)
    assert (rej.reason, rej.permanent) == (reason, permanent)
    assert field in rej.message


def test_quantities():
    q = rejections.parse_quantity
    assert (q("500m"), q("2"), q("64Gi"), q("1e3"), q("1.5G")) == (
        q("0.5"), 2, 64 * 2 ** 30, 1000, 1_500_000_000)
    assert q("lots") is None


def test_path_storage_lives_on_the_claim_mounted_at_that_path_on_every_rank():
    """A path storage.uri without a volume vanished with each container (restarts began at
    step 0, status.output.uri named nothing); the claim is now mounted at that path."""
    body = job_body({"storage": {"uri": "/shared/runs", "persistentVolumeClaim": {"claimName": "team-nfs"}}})
    spec = builders.parse_spec(body["spec"])
    for pod in builders.build_pods(builders.JobRef.from_body(body), spec, 0):
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert mounts["storage"]["mountPath"] == "/shared/runs"
        assert volumes["storage"]["persistentVolumeClaim"] == {"claimName": "team-nfs"}
    assert builders.model_uri(builders.JobRef.from_body(body), spec).startswith("/shared/runs/team-a/tiny/")


def test_a_hung_api_call_times_out(monkeypatch):
    """An API server that accepts a connection and never answers must not freeze a job's
    reconcile for good: every call has a deadline."""
    import asyncio
    import socket
    import threading

    import kubernetes

    from sftjob_operator import kube

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    conf = kubernetes.client.Configuration()
    conf.host = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setattr(kube, "API_TIMEOUT", (0.5, 0.5))
    client = kube.Kube(kubernetes.client.ApiClient(conf))

    async def call():
        return await asyncio.wait_for(client.list_pods("ns", "job"), timeout=20)

    import time

    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        asyncio.run(call())
    assert not isinstance(err.value, asyncio.TimeoutError), "the call hung until the test's own limit"
    assert time.monotonic() - t0 < 10
    server.close()


def test_a_dead_machines_survivor_failing_first_is_counted_as_the_preemption():
    """Machine death: node-0 dies with rank 0; rank 1 loses its collective and exits 1 within
    seconds, while rank 0 still reads Running on a Ready node. Charged as a failure, this
    spent the backoffLimit on a preemption. The verdict waits for node-0's heartbeat."""
    from sftjob_operator.nodes import NodeLease

    body, pods = running_job()
    pods = [dict(p, spec={**p["spec"], "nodeName": f"node-{i}"}) for i, p in enumerate(pods)]
    failed = terminated(pods[1], 1, "TrainingError: RuntimeError: Connection closed by peer")
    failed["spec"] = pods[1]["spec"]
    failed["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = "2026-01-01T12:00:20Z"
    gang = [pods[0], failed]
    last_beat = {"node-0": NodeLease(renewed=at(18), duration_s=40)}   # before the failure

    waiting = reconcile.plan(body, gang, at(22), node_ready={"node-0": NodeReadiness(True)}, node_leases=last_beat)
    assert waiting.status is None or waiting.status.get("phase") == "Running"
    assert not waiting.delete_pods and waiting.requeue_after <= 2.0

    lost = reconcile.plan(body, gang, at(58), node_ready={"node-0": NodeReadiness(True)}, node_leases=last_beat)
    assert lost.status["phase"] == "Restarting"
    assert lost.status["restarts"] == {**lost.status["restarts"], "preemptions": 1, "failures": 0}

    alive = {"node-0": NodeLease(renewed=at(24), duration_s=40)}          # a heartbeat after it
    # within ECHO_SETTLE_S of the failure the verdict still waits for rank 0's own status
    settling = reconcile.plan(body, gang, at(25), node_ready={"node-0": NodeReadiness(True)}, node_leases=alive)
    assert not settling.delete_pods and settling.requeue_after <= 2.0
    failure = reconcile.plan(body, gang, at(31), node_ready={"node-0": NodeReadiness(True)}, node_leases=alive)
    assert failure.status["restarts"] == {**failure.status["restarts"], "preemptions": 0, "failures": 1}


def _bound(pod, seconds):
    """The pod as the API server shows it once the scheduler bound it at at(seconds)."""
    pod = dict(pod, status={**pod["status"], "conditions": [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": iso(at(seconds))}]})
    return pod


def test_a_node_back_from_the_dead_does_not_restart_the_gang_placed_on_it():
    """make chaos: node-1 was lost (one preemption, right), its kubelet came back, and the new
    gang's rank 0 was bound to it while the operator's last reading of node-1 still said
    NotReady. The new gang was restarted a second time ("NodeNotReady: rank 0"): two
    preemptions for one lost node. A NotReady reading from before a pod was bound to the node
    is outdated for that pod (the scheduler binds only to a Ready node)."""
    body, pods = running_job()
    pods = [_bound(p, 3) for p in pods]
    lost = {"node-1": NodeReadiness(False, since=at(25)), "node-0": NodeReadiness(True, since=at(0))}
    plan = reconcile.plan(body, pods, at(30), node_ready=lost)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"]["preemptions"] == 1
    assert plan.restart_cause == "preemption" and "NodeNotReady" in plan.status["message"]
    body = apply(body, plan)
    body = apply(body, reconcile.plan(body, [], at(41)))
    # the new gang: rank 0 on the restored node-1, bound at 12:00:50
    new = [_bound(p, 50) for p in pods_for(body, attempt=1)]
    new[0]["spec"]["nodeName"], new[1]["spec"]["nodeName"] = "node-1", "node-0"
    plan = reconcile.plan(body, new, at(52), node_ready=lost)   # the reading from 12:00:25
    assert plan.status["phase"] == "Running", plan.status.get("message")
    assert plan.status["restarts"]["preemptions"] == 1 and not plan.delete_pods
    # node-1 lost again after the binding: that is a second preemption
    again = {**lost, "node-1": NodeReadiness(False, since=at(70))}
    plan = reconcile.plan(apply(body, plan), new, at(75), node_ready=again)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"]["preemptions"] == 2


def test_node_readings_carry_when_the_node_went_not_ready():
    """The rule above needs the Node's Ready lastTransitionTime: without it every NotReady
    reading is held against every pod, as before the fix."""
    import asyncio

    import kubernetes

    from sftjob_operator import kube

    client = kube.Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration()))
    nodes = {"node-1": {"status": {"conditions": [
        {"type": "MemoryPressure", "status": "False", "lastTransitionTime": "2026-01-01T11:00:00Z"},
        {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T12:00:25Z"}]}},
             "node-0": {"status": {"conditions": [
                 {"type": "Ready", "status": "True", "lastTransitionTime": "not a time"}]}}}

    async def read(fn, name):
        return nodes[name]

    client._call = read
    got = asyncio.run(client.node_ready({"node-0", "node-1"}))
    assert got == {"node-1": NodeReadiness(False, since=at(25)), "node-0": NodeReadiness(True, since=None)}
