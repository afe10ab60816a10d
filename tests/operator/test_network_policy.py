"""A job's NetworkPolicy, enforced (issue 28 item 5): with SIG Network's reference
implementation deciding every new connection of the cluster's pods (hack/localcluster/netpol.py),
a 2-rank job trains to Succeeded, its ranks reach each other's rendezvous port, and nothing
else does: a pod of another namespace (even one wearing the job's label) and a pod of the
job's own namespace that is not the job's are dropped at the rendezvous port; the metrics port
takes the monitoring namespace the operator names and no other.

A dropped connection times out, a closed port answers at once (refused): each probe tells the
two apart, so a port that closed because the job ended cannot pass for a policy.

The operator runs on the host as root here. Like upstream, the enforcer lets the host's root
user through (kubelet probes), so its progress readings are not what this tests; the
monitoring namespace's pod stands for the operator's and Prometheus's pods."""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from hack.localcluster import images, netpol
from hack.localcluster.operator_proc import OperatorProcess
from sftjob_operator.builders import MASTER_PORT, METRICS_PORT
from tests.fixtures.cluster import wait_for

from .cluster_kit import apply, example, get_job, phase_is, pods_of, wait_job

pytestmark = pytest.mark.cluster

JOB = "fenced"
# Long enough that the probes (seconds, all at once) run while the job trains: the example
# trains at about 0.5 s a step here on a quiet machine.
STEPS = 150
# Connects to each HOST:PORT of argv; prints one JSON object: target -> open | dropped | refused.
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, int(port))); out[target] = "open"
    except socket.timeout:
        out[target] = "dropped"
    except ConnectionRefusedError:
        out[target] = "refused"
    finally:
        s.close()
print(json.dumps(out))
"""
RESTRICTED_SC = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
POD_SC = {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.fixture
def extra_namespaces(cluster):
    made: list[str] = []

    def make(prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        cluster.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                   "metadata": {"name": name, "labels": {"sftjob.io/test": "true"}}})
        wait_for(lambda: cluster.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60,
                 what=f"default ServiceAccount in {name}")
        made.append(name)
        return name

    yield make
    for name in made:
        cluster.kube.delete(f"/api/v1/namespaces/{name}")


def probe_pod(cluster, ns: str, name: str, labels: dict[str, str]) -> None:
    """A pod that sleeps, from the operator image (Python, already on every node)."""
    cluster.kube.create(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
        "spec": {"securityContext": POD_SC, "terminationGracePeriodSeconds": 0, "containers": [{
            "name": "probe", "image": images.image_refs()["operator"], "imagePullPolicy": "Never",
            "command": ["sleep", "3600"], "securityContext": RESTRICTED_SC}]}})


def probe(cluster, ns: str, pod: str, *targets: str, container: str | None = None) -> dict[str, str]:
    args = ["-n", ns, "exec", pod, *(["-c", container] if container else []), "--", "python3", "-c", PROBE, *targets]
    return json.loads(cluster.kubectl(*args, timeout=60).stdout.strip().splitlines()[-1])


def test_only_the_jobs_own_pods_reach_its_ranks(cluster, crd, example_ns, extra_namespaces, tmp_path):
    ns = example_ns
    monitoring, other = extra_namespaces("monitoring"), extra_namespaces("other")
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": monitoring}}}]
    op = OperatorProcess(cluster.env, tmp_path / "operator.log", namespaces=[ns],
                         extra_args=["--job-network-policy", "--trainer-metrics-from", json.dumps(peers)])
    with netpol.enforcing(cluster.cfg, tmp_path / "netpol.log") as enforcer_log:
        op.start()
        try:
            # The outsider wears the job's label: a podSelector without a namespaceSelector
            # means the policy's own namespace, so the label alone must not let it in.
            probe_pod(cluster, other, "outsider", {"sftjob.io/job-name": JOB})
            probe_pod(cluster, ns, "neighbour", {"app": "neighbour"})
            probe_pod(cluster, monitoring, "monitor", {"app": "monitor"})
            apply(cluster, ns, example(JOB, **{"training.totalTrainingSteps": STEPS}))
            for pod_ns, pod in ((other, "outsider"), (ns, "neighbour"), (monitoring, "monitor")):
                cluster.wait_pod_phase(pod_ns, pod, "Running", timeout=120)
            wait_job(cluster, ns, JOB, op, lambda j: (j.get("status", {}).get("progress") or {}).get("step", 0) >= 1
                     and j, timeout=600, what="the job to train (its ranks rendezvoused through the policy)")
            rank0 = next(p for p in pods_of(cluster, ns, JOB) if p["metadata"]["name"].endswith("-node-0"))
            ip = rank0["status"]["podIP"]
            rendezvous, metrics = f"{ip}:{MASTER_PORT}", f"{ip}:{METRICS_PORT}"

            probers = {"rank 1": (ns, f"{JOB}-node-1"), "outsider": (other, "outsider"),
                       "neighbour": (ns, "neighbour"), "monitor": (monitoring, "monitor")}
            with ThreadPoolExecutor(len(probers)) as pool:
                futures = {who: pool.submit(probe, cluster, pod_ns, pod, rendezvous, metrics)
                           for who, (pod_ns, pod) in probers.items()}
                seen = {who: f.result() for who, f in futures.items()}
            still = get_job(cluster, ns, JOB)["status"]
            assert still["phase"] == "Running" and still["progress"]["step"] < STEPS, (
                f"the job ended during the probes, which then prove nothing: step {still['progress']['step']}, "
                f"seen {seen}")
            expected = {
                "rank 1": {rendezvous: "open", metrics: "open"},          # the job's own pods: anything
                "outsider": {rendezvous: "dropped", metrics: "dropped"},  # another namespace, same label
                "neighbour": {rendezvous: "dropped", metrics: "dropped"},  # same namespace, not the job's
                "monitor": {rendezvous: "dropped", metrics: "open"},       # the named peers: metrics only
            }
            assert seen == expected, f"{json.dumps(seen, indent=1)}\nenforcer log: {enforcer_log}"

            job = wait_job(cluster, ns, JOB, op, phase_is("Succeeded", "Failed"), timeout=600, what="the job to end")
            assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"])[-2000:]
            assert (job["status"].get("restarts") or {}).get("total", 0) == 0, job["status"]["restarts"]
        finally:
            op.stop()
