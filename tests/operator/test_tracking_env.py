"""spec.tracking on the pods (tracking_env.py): the trainer's section with the job's defaults,
credentials only as secretKeyRefs, and nothing at all for a job that tracks nothing."""
from __future__ import annotations

import json

import pytest
from sftjob_contract.config import SFTConfig

from sftjob_operator import builders

from .op_testkit import job_body

pytestmark = pytest.mark.unit

TRACKED = {"tracking": {"tensorboard": True,
                        "mlflow": {"trackingUri": "https://mlflow.example:5000", "credentialsSecret": "mlflow-creds"},
                        "wandb": {"mode": "offline", "apiKeySecret": "wandb-key"}}}


def _build(**overrides):
    body = job_body(overrides)
    job, spec = builders.JobRef.from_body(body), builders.parse_spec(body["spec"])
    return job, spec, builders.trainer_config(job, spec), builders.build_pod(job, spec, rank=0, attempt=0)


def _env(pod) -> dict[str, dict]:
    return {e["name"]: e for c in pod["spec"]["containers"] for e in c.get("env", [])}


def test_a_job_without_tracking_gets_no_tracking_config_and_no_tracking_env():
    _, _, config, pod = _build()
    assert "tracking" not in config
    assert not [n for n in _env(pod) if n.startswith(("MLFLOW_", "WANDB_"))]


def test_tracking_defaults_come_from_the_job_and_credentials_only_from_secrets():
    job, _, config, pod = _build(**TRACKED)
    t = SFTConfig.model_validate(config).tracking
    assert t.tensorboard and t.mlflow.experiment == job.namespace and t.mlflow.run_name == job.name
    assert t.wandb.project == job.namespace and t.wandb.mode == "offline"
    env = _env(pod)
    for key, secret, optional in (("MLFLOW_TRACKING_TOKEN", "mlflow-creds", True),
                                  ("MLFLOW_TRACKING_USERNAME", "mlflow-creds", True),
                                  ("MLFLOW_TRACKING_PASSWORD", "mlflow-creds", True),
                                  ("WANDB_API_KEY", "wandb-key", False)):
        assert "value" not in env[key], key
        ref = env[key]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional", False)) == (secret, key, optional)


def test_explicit_names_win_over_the_job_defaults():
    _, _, config, _ = _build(tracking={"mlflow": {"trackingUri": "http://m:5000", "experiment": "sft",
                                                        "runName": "r1"}, "wandb": {"project": "p"}})
    assert config["tracking"]["mlflow"] | {} == {"tracking_uri": "http://m:5000", "experiment": "sft", "run_name": "r1"}
    assert config["tracking"]["wandb"]["project"] == "p" and config["tracking"]["tensorboard"] is False
    assert "Secret" not in json.dumps(config)


@pytest.mark.parametrize("tracking, field", [
    ({"mlflow": {"trackingUri": "ftp://m:5000"}}, "trackingUri"),
    ({"mlflow": {"trackingUri": "http://m:5000", "token": "t"}}, "token"),
    ({"wandb": {"apiKey": "k"}}, "apiKey"),
    ({"wandb": {"mode": "cloud"}}, "mode"),
])
def test_bad_tracking_specs_are_refused_naming_the_field(tracking, field):
    with pytest.raises(Exception) as err:
        builders.parse_spec(job_body({"tracking": tracking})["spec"])
    assert field in str(err.value)
