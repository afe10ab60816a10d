"""Bad input on the real API server and operator: refused at apply time naming the field,
or, where only pod admission or the cluster can judge, failed promptly with a condition,
a reason, the field named and an Event. And the smallest valid spec is accepted and runs."""
from __future__ import annotations

import json

import pytest

from sftjob_operator import api
from tests.fixtures.cluster import wait_for

from .cluster_kit import apply, condition, diagnose, example, get_job, refusals, wait_job

pytestmark = pytest.mark.cluster


def minimal(name: str, train: str = "s3://sftjob-examples/data/train.parquet") -> dict:
    return {"apiVersion": "sftjob.io/v1alpha1", "kind": "SFTJob", "metadata": {"name": name}, "spec": {
        "model": {"path": "s3://sftjob-examples/models/tiny"},
        "data": {"trainFiles": [train]},
        "storage": {"uri": "s3://sftjob-examples/runs", "endpoint": "http://10.244.0.1:9000",
                    "region": "us-east-1", "credentialsSecretRef": {"name": "sftjob-s3"}},
    }}


def events_of(cluster, ns: str, name: str) -> list[dict]:
    return cluster.kube.get(f"/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3D{name}")["items"]


def small_train_file(cluster) -> str:
    """The example's training data cut to 64 rows (8 steps at the default batch of 8)."""
    import io

    import pyarrow.parquet as pq

    s3 = cluster.s3()
    rows = pq.read_table(io.BytesIO(s3.get_object(Bucket="sftjob-examples", Key="data/train.parquet")["Body"].read()))
    out = io.BytesIO()
    pq.write_table(rows.slice(0, 64), out)
    s3.put_object(Bucket="sftjob-examples", Key="data/minimal/train.parquet", Body=out.getvalue())
    return "s3://sftjob-examples/data/minimal/train.parquet"


def test_minimal_spec_is_accepted_shows_every_default_and_runs(cluster, scoped_operator, example_ns):
    ns, obj = example_ns, minimal("minimal", small_train_file(cluster))
    apply(cluster, ns, obj)
    stored = get_job(cluster, ns, "minimal")["spec"]
    # The API server filled in every section and field, exactly as the operator's models do.
    expected = api.SFTJobSpec.model_validate(obj["spec"]).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert stored == expected
    assert stored["resources"]["nodes"] == 1 and stored["runPolicy"]["backoffLimit"] == 3
    job = wait_job(cluster, ns, "minimal", scoped_operator,
                   lambda j: j if j.get("status", {}).get("phase") in ("Succeeded", "Failed") else None,
                   600, what="the minimal job to finish")
    assert job["status"]["phase"] == "Succeeded", diagnose(cluster, ns, "minimal", scoped_operator)


# Each was accepted by the API server before and failed later or never.
INVALID = [
    ("beta1 of 1", {"training.optim.betas": [1.0, 0.95]}, "spec.training.optim.betas[0]"),
    ("negative beta2", {"training.optim.betas": [0.9, -0.1]}, "spec.training.optim.betas[1]"),
    ("negative seed", {"training.seed": -1}, "spec.training.seed"),
    ("s3 without a bucket", {"storage.uri": "s3://"}, "spec.storage.uri"),
    ("s3 bucket not a bucket name", {"model.path": "s3://My_Bucket/m"}, "spec.model.path"),
    ("endpoint without a host", {"storage.endpoint": "http://"}, "spec.storage.endpoint"),
    ("endpoint with only a path", {"storage.endpoint": "https:///minio"}, "spec.storage.endpoint"),
    ("response column is the prompt", {"data.responseKey": "prompt"}, "spec.data.responseKey"),
    ("env overrides MASTER_ADDR", {"resources.env": [{"name": "MASTER_ADDR", "value": "evil"}]},
     "spec.resources.env[0].name"),
    ("env overrides an SFTJOB_ variable", {"resources.env": [{"name": "SFTJOB_ATTEMPT", "value": "9"}]},
     "spec.resources.env[0].name"),
    ("credential in plain env", {"resources.env": [{"name": "HF_TOKEN", "value": "hf_x"}]},
     "spec.resources.env[0].value"),
    ("AWS key in plain env", {"resources.env": [{"name": "AWS_SECRET_ACCESS_KEY", "value": "s"}]},
     "spec.resources.env[0]"),
    ("env name with =", {"resources.env": [{"name": "A=B", "value": "1"}]}, "spec.resources.env[0].name"),
    ("duplicate env", {"resources.env": [{"name": "X", "value": "1"}, {"name": "X", "value": "2"}]},
     "spec.resources.env[1]"),
    ("malformed memory", {"resources.memory": "4 GB"}, "spec.resources.memory"),
    ("malformed cpu", {"resources.cpu": "two"}, "spec.resources.cpu"),
    ("toleration Exists with a value", {"resources.tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
     "spec.resources.tolerations[0].value"),
    ("toleration seconds without NoExecute",
     {"resources.tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 5}]},
     "spec.resources.tolerations[0].tolerationSeconds"),
    ("bad node selector key", {"resources.nodeSelector": {"bad key!": "x"}}, "spec.resources.nodeSelector"),
    ("bad node selector value", {"resources.nodeSelector": {"zone": "a b"}}, "spec.resources.nodeSelector"),
    ("bad priority class name", {"resources.priorityClassName": "Urgent!"}, "spec.resources.priorityClassName"),
    ("bad service account name", {"resources.serviceAccountName": "A_B"}, "spec.resources.serviceAccountName"),
    ("image with a space", {"resources.image": "trainer latest"}, "spec.resources.image"),
    ("path storage without a volume", {"storage.uri": "/runs", "storage.endpoint": None},
     "spec.storage.persistentVolumeClaim"),
    ("watchdog too short", {"runPolicy.progressDeadlineSeconds": 5}, "spec.runPolicy.progressDeadlineSeconds"),
    ("flash-attention in fp32", {"model.attnImplementation": "flash_attention_2"}, "spec.model.attnImplementation"),
    ("negative checkpoint seconds", {"checkpoint.intervalSeconds": -1}, "spec.checkpoint.intervalSeconds"),
    # Passed the old one-regex subdomain pattern; every pod create was then refused.
    ("Secret name with an empty label", {"storage.credentialsSecretRef": {"name": "sftjob..s3"}},
     "spec.storage.credentialsSecretRef.name"),
    ("Secret name with a label starting with '-'", {"storage.credentialsSecretRef": {"name": "sftjob.-s3"}},
     "spec.storage.credentialsSecretRef.name"),
    ("scratch class without a size", {"resources.scratch": {"storageClassName": "local-nvme"}},
     "spec.resources.scratch.storageClassName"),
    ("malformed scratch size", {"resources.scratch": {"size": "lots"}}, "spec.resources.scratch.size"),
    # Rank 1 would ask for a second device on a one-GPU pod.
    ("more processes than GPUs", {"resources.gpusPerNode": 1, "resources.processesPerNode": 2,
                                  "data.microBatchSizePerGpu": 64}, "spec.resources.processesPerNode"),
]


def test_held_out_invalid_specs_are_refused_naming_the_field(cluster, crd, namespace):
    failures = refusals(cluster, namespace, INVALID, "held-out")
    assert not failures, "\n".join(failures)
    # The valid neighbours of those cases are accepted.
    ok = example("held-out-ok", **{
        "resources.env": [{"name": "TOKENIZERS_PARALLELISM", "value": "false"},
                          {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "resources.tolerations": [{"operator": "Exists"}], "resources.nodeSelector": {"kubernetes.io/os": "linux"},
        "suspend": True})
    apply(cluster, namespace, ok)


def _failed_with(cluster, ns, name, op):
    job = wait_for(lambda: (j := get_job(cluster, ns, name)).get("status", {}).get("phase") == "Failed" and j,
                   60, interval=0.5, what=f"{name} to fail")
    failed = condition(job, "Failed")
    events = [e for e in events_of(cluster, ns, name) if e["type"] == "Warning"]
    return failed, events


@pytest.mark.parametrize("what, overrides, setup, reason, field", [
    ("missing PriorityClass", {"resources.priorityClassName": "no-such-class"}, None, "PodRejected",
     "spec.resources.priorityClassName"),
    ("missing ServiceAccount", {"resources.serviceAccountName": "no-such-sa"}, None, "PodRejected",
     "spec.resources.serviceAccountName"),
    ("pod larger than the quota", {"resources.cpu": "2"},
     {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "small"},
      "spec": {"hard": {"requests.cpu": "1"}}},
     "QuotaExceeded", "spec.resources"),
    # The job's other children: a name someone else holds is never taken over, and a refused
    # Service fails the job like a refused pod (it retried every 5 s forever, Pending).
    ("a user's ConfigMap holds the config's name", {},
     {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "refused-config"}, "data": {"keep": "me"}},
     "NameTaken", "ConfigMap"),
    ("a ClusterIP Service holds the job's name", {},
     {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "refused"},
      "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}}}, "NameTaken", "Service"),
    ("a quota of no Services", {},
     {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "small"}, "spec": {"hard": {"services": "0"}}},
     "QuotaExceeded", "Service refused"),
])
def test_pods_the_api_server_refuses_fail_the_job_naming_the_field(cluster, scoped_operator, example_ns,
                                                                   what, overrides, setup, reason, field):
    ns, name = example_ns, "refused"
    if setup:
        cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(setup))
    if setup and setup["kind"] == "ResourceQuota":
        quota = f"/api/v1/namespaces/{ns}/resourcequotas/small"
        wait_for(lambda: cluster.kube.get(quota).get("status", {}).get("hard"), 30, what="the quota to be counted")
    apply(cluster, ns, example(name, **overrides))
    failed, events = _failed_with(cluster, ns, name, scoped_operator)
    assert failed["reason"] == reason and field in failed["message"], failed
    assert any(e["reason"] == reason and field in e["message"] for e in events), events
    if setup and setup["kind"] == "ConfigMap":  # left as its owner wrote it
        assert cluster.kube.get(f"/api/v1/namespaces/{ns}/configmaps/refused-config")["data"] == {"keep": "me"}


def test_missing_secret_is_named_while_waiting_and_at_the_startup_deadline(cluster, scoped_operator, example_ns):
    ns, name = example_ns, "no-secret"
    apply(cluster, ns, example(name, **{"storage.credentialsSecretRef": {"name": "not-created-yet"},
                                        "runPolicy.startupDeadlineSeconds": 25}))

    def waiting_named():
        job = get_job(cluster, ns, name)
        ready = condition(job, "Ready") if job.get("status") else None
        return job if ready and "spec.storage.credentialsSecretRef.name" in ready.get("message", "") else None

    job = wait_for(waiting_named, 40, interval=0.5, what="a condition naming the missing Secret")
    assert job["status"]["phase"] == "Pending" and "not-created-yet" in condition(job, "Ready")["message"]
    failed, events = _failed_with(cluster, ns, name, scoped_operator)
    assert failed["reason"] == "StartupDeadlineExceeded"
    assert "spec.storage.credentialsSecretRef.name" in failed["message"] and "not-created-yet" in failed["message"]
    assert any("not-created-yet" in e["message"] for e in events)


def test_read_only_output_credentials_fail_the_job_within_one_checkpoint_interval(cluster, scoped_operator,
                                                                                  example_ns):
    """Credentials that may read the model and data but not write the output: every periodic
    commit failed, was only logged, and the job restarted from step 0 backoffLimit times after
    training to the end. Now the first write the run needs is refused, and the job fails at
    once, naming spec.storage."""
    import boto3

    ns, name = example_ns, "read-only"
    e = cluster.env
    sts = boto3.client("sts", endpoint_url=e["AWS_ENDPOINT_URL"], aws_access_key_id=e["AWS_ACCESS_KEY_ID"],
                       aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"], region_name=e["AWS_REGION"])
    read_only = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                                                          "Resource": ["arn:aws:s3:::sftjob-examples",
                                                                       "arn:aws:s3:::sftjob-examples/*"]}]}
    # A MinIO session whose policy denies every write: what read-only output credentials are.
    creds = sts.assume_role(RoleArn="arn:minio:iam:::role/sftjob-read-only", RoleSessionName="read-only",
                            Policy=json.dumps(read_only), DurationSeconds=3600)["Credentials"]
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-read-only"}, "type": "Opaque",
        "stringData": {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
                       "AWS_SESSION_TOKEN": creds["SessionToken"]}}))
    apply(cluster, ns, example(name, **{
        "storage.credentialsSecretRef": {"name": "s3-read-only"},
        "resources.env": [{"name": "AWS_SESSION_TOKEN",
                           "valueFrom": {"secretKeyRef": {"name": "s3-read-only", "key": "AWS_SESSION_TOKEN"}}}],
        "checkpoint.interval": 5, "runPolicy.backoffLimit": 3}))
    job = wait_job(cluster, ns, name, scoped_operator, lambda j: j.get("status", {}).get("phase") == "Failed" and j,
                   timeout=300, what="the job to fail")
    failed = condition(job, "Failed")
    assert failed["reason"] == "StorageDenied" and "spec.storage.uri" in failed["message"], failed
    assert "AccessDenied" in failed["message"], failed
    assert job["status"]["restarts"]["failures"] == 0                       # no retry that cannot help
    assert (job["status"].get("progress", {}).get("step") or 0) <= 5      # within one checkpoint interval
    assert creds["SecretAccessKey"] not in failed["message"] and creds["SessionToken"] not in failed["message"]
