"""Desired-state builders: whole manifests against golden YAML, plus the rules they encode."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from .op_testkit import job_body
from sftjob_contract.config import SFTConfig

from sftjob_operator import builders

pytestmark = pytest.mark.unit
GOLDEN = Path(__file__).parent / "golden"


def _job_and_spec(**overrides):
    body = job_body(overrides)
    return builders.JobRef.from_body(body), builders.parse_spec(body["spec"])


def _pod_without_config_hash(job, spec):
    # The hash follows the trainer's config, which grows with every new trainer key; the
    # config's content is checked by test_trainer_config_is_valid_and_maps_every_section.
    pod = builders.build_pod(job, spec, rank=1, attempt=3)
    pod["metadata"]["annotations"]["sftjob.io/config-hash"] = "<hash>"
    return pod


@pytest.mark.parametrize("name, make", [
    ("pod-rank1.yaml", _pod_without_config_hash),
    ("service.yaml", lambda j, s: builders.build_service(j)),
])
def test_manifests_match_golden(name, make):
    job, spec = _job_and_spec()
    got = yaml.safe_dump(make(job, spec), sort_keys=False)
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def test_config_map_holds_the_trainer_config():
    job, spec = _job_and_spec()
    cm = builders.build_config_map(job, spec)
    assert cm["metadata"]["name"] == "tiny-config"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == job.uid
    assert yaml.safe_load(cm["data"]["config.yaml"]) == builders.trainer_config(job, spec)


def test_names_are_deterministic_and_fit_dns():
    job, spec = _job_and_spec()
    names = [p["metadata"]["name"] for p in builders.build_pods(job, spec, attempt=0)]
    assert names == ["tiny-node-0", "tiny-node-1"]
    long = builders.JobRef(name="a" * 52, namespace="ns", uid="u")
    assert len(builders.pod_name(long, 1023)) <= 63


def test_labels_owner_and_env():
    job, spec = _job_and_spec()
    pod = builders.build_pod(job, spec, rank=1, attempt=2)
    labels = pod["metadata"]["labels"]
    assert labels[builders.LABEL_JOB] == "tiny" and labels[builders.LABEL_RANK] == "1"
    assert labels[builders.LABEL_ATTEMPT] == "2"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["uid"] == job.uid and owner["controller"] is True
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "tiny-node-0.tiny.team-a.svc"
    assert (env["WORLD_SIZE"], env["RANK"], env["NODE_RANK"], env["MASTER_PORT"]) == ("2", "1", "1", "29500")
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"


def test_grace_period_bounds_trainer_and_torchrun():
    job, spec = _job_and_spec()
    pod = builders.build_pod(job, spec, rank=0, attempt=0)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    stop = builders.trainer_config(job, spec)["trainer"]["stop_timeout_s"]
    assert stop < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace == 40


def test_torchrun_arguments():
    job, spec = _job_and_spec(**{"resources.processesPerNode": 4, "data.trainBatchSize": 8})
    cmd = builders.trainer_command(job, spec, rank=1)
    assert cmd == ["python", "-m", "sftjob_trainer.launch", "--nnodes=2", "--nproc-per-node=4", "--node-rank=1",
                   "--master-addr=tiny-node-0.tiny.team-a.svc", "--master-port=29500",
                   "--", "--config", "/etc/sftjob/config.yaml"]
    single, sspec = _job_and_spec(**{"resources.nodes": 1})
    assert builders.trainer_command(single, sspec, 0)[0] == "python"


def test_trainer_config_is_valid_and_maps_every_section():
    job, spec = _job_and_spec(**{"output.mergeLora": False})
    cfg = SFTConfig.model_validate(builders.trainer_config(job, spec))
    assert cfg.model.path == "s3://models/tiny"
    assert cfg.data.train_files == ["s3://data/train.parquet"]
    assert cfg.lora.rank == 8 and cfg.lora.merge_on_export is False
    assert cfg.trainer.save_freq == 5 and cfg.trainer.total_training_steps == 20
    assert cfg.trainer.output_dir == f"s3://runs/team-a/tiny/{job.uid}"
    assert cfg.trainer.metrics_port == builders.METRICS_PORT


def test_pod_security_and_restart_policy():
    job, spec = _job_and_spec(**{"resources.gpusPerNode": 8, "resources.memory": "64Gi",
                                 "resources.tolerations": [{"key": "gpu", "operator": "Exists"}]})
    pod = builders.build_pod(job, spec, rank=0, attempt=0)
    ps = pod["spec"]
    assert ps["restartPolicy"] == "Never"
    assert ps["securityContext"]["runAsNonRoot"] is True
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = ps["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "8"}
    assert ps["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert ps["hostname"] == "tiny-node-0" and ps["subdomain"] == "tiny"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in ps["volumes"]


@pytest.mark.parametrize("overrides, match", [
    ({"data.trainBatchSize": 3}, "world size"),  # CEL rejects this at admission; here as a fallback
    ({"data.trainBatchSize": 6, "resources.nodes": 1, "data.microBatchSizePerGpu": 4}, "world size"),
])
def test_runtime_invalid_spec_is_reported(overrides, match):
    body = job_body(overrides)
    job = builders.JobRef.from_body(body)
    with pytest.raises(builders.InvalidSpec, match=match):
        builders.trainer_config(job, builders.parse_spec(body["spec"]))


def test_scratch_is_a_declared_volume_sized_and_requested():
    """Checkpoint staging and the model cache lived on the container's writable layer with no
    request: at 7B that is tens of GB per node the scheduler never heard of (DiskPressure)."""
    job, spec = _job_and_spec(**{"resources.scratch": {"size": "200Gi"}})
    ps = builders.build_pod(job, spec, rank=0, attempt=0)["spec"]
    c = ps["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert {"name": "scratch", "mountPath": builders.SCRATCH_DIR} in c["volumeMounts"]
    assert env["SFTJOB_LOCAL_DIR"].startswith(builders.SCRATCH_DIR + "/")
    assert env["SFTJOB_MODEL_CACHE"].startswith(builders.SCRATCH_DIR + "/")
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "200Gi"}} in ps["volumes"]
    assert c["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    # A generic ephemeral volume of the user's class instead: its capacity, not node ephemeral storage.
    job, spec = _job_and_spec(**{"resources.scratch": {"size": "500Gi", "storageClassName": "local-nvme"}})
    ps = builders.build_pod(job, spec, rank=0, attempt=0)["spec"]
    [vol] = [v for v in ps["volumes"] if v["name"] == "scratch"]
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["resources"]["requests"]["storage"] == "500Gi"
    assert "ephemeral-storage" not in ps["containers"][0].get("resources", {}).get("requests", {})


def test_the_job_network_policy_admits_only_its_own_ranks_and_the_metrics_peers():
    job, _ = _job_and_spec()
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sftjob-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "sftjob-operator"}}}
    pol = builders.build_network_policy(job, [operator])
    assert pol["metadata"]["name"] == "tiny-ranks" and pol["metadata"]["ownerReferences"][0]["uid"] == job.uid
    assert pol["spec"]["podSelector"] == {"matchLabels": {builders.LABEL_JOB: "tiny"}}
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    own, metrics = pol["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {builders.LABEL_JOB: "tiny"}}}]}   # every port
    assert metrics == {"from": [operator], "ports": [{"port": builders.METRICS_PORT, "protocol": "TCP"}]}
    # Without peers for the metrics port, nobody but the ranks reaches the pods.
    assert builders.build_network_policy(job, [])["spec"]["ingress"] == [own]
