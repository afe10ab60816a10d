"""The API models and the generated CRD: drift, structure, defaults shared with the trainer."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sftjob_contract.config import DataConfig, LoraConfig, OptimConfig, TrainerConfig

from sftjob_operator import api, crd, resources

pytestmark = pytest.mark.unit
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "sftjob.io_sftjobs.yaml"


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.get("properties", {}).items():
            yield from _walk(v, f"{path}.{k}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from _walk(node[key], f"{path}[{key}]")


def test_committed_crd_matches_models():
    assert CRD_FILE.read_text() == crd.render(), "crds/ is stale: run `make crds` and commit the result"


def test_schema_is_structural_and_documented():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema["properties"]["spec"]):
        assert "description" in node or path.endswith(("[items]", "[additionalProperties]")), path
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "prefixItems", "nullable", "const"):
            assert banned not in node, (path, banned)
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("type") == "array":
            assert "maxItems" in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), path


def test_status_prunes_unknown_fields_and_has_subresource():
    """A misspelled status field must not be stored silently: the API server prunes it."""
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status
    assert "restartAfter" in status["properties"] and "launchedAttempt" in status["properties"]
    cols = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert cols == ["Phase", "Reason", "Step", "Done%", "Loss", "Restarts", "Nodes", "Age"]


def test_names():
    names = crd.crd()["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("SFTJob", "sftjobs", ["sft"])


@pytest.mark.parametrize("model, section", [
    (api.OptimSpec, OptimConfig), (api.LoraSpec, LoraConfig), (api.DataSpec, DataConfig),
])
def test_trainer_sections_share_defaults(model, section):
    ours = model.model_fields
    for name, info in section.model_fields.items():
        if name not in ours:
            continue
        theirs = info.default_factory() if info.default_factory else info.default
        assert ours[name].default == theirs, name
        assert ours[name].description, name


def test_training_run_fields_come_from_trainer():
    for name in api.TRAINING_RUN_FIELDS:
        assert api.TrainingSpec.model_fields[name].default == TrainerConfig.model_fields[name].default
    assert api.CheckpointSpec().interval == TrainerConfig.model_fields["save_freq"].default
    assert api.CheckpointSpec().interval_seconds == TrainerConfig.model_fields["save_interval_s"].default


def test_spec_defaults_fill_in():
    spec = api.SFTJobSpec.model_validate({
        "model": {"path": "/m"}, "data": {"trainFiles": ["/d"]}, "storage": {"uri": "/o"}})
    assert spec.resources.nodes == 1 and spec.run_policy.backoff_limit == 3
    assert spec.training.lora.rank == 0 and spec.training.optim.lr == OptimConfig().lr


def test_inline_credentials_are_not_a_field():
    with pytest.raises(ValueError, match="accessKey"):
        api.StorageSpec.model_validate({"uri": "s3://b", "accessKey": "AKIA"})
    props = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert set(props["storage"]["properties"]) == {"uri", "endpoint", "region", "credentialsSecretRef",
                                                 "persistentVolumeClaim"}
    assert "x-kubernetes-preserve-unknown-fields" not in props["storage"]


def test_descriptions_use_crd_spellings():
    text = yaml.safe_dump(crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    for snake in ("train_batch_size", "prompt_key", "max_length", "total_epochs"):
        assert snake not in text


def test_every_optional_section_defaults_to_an_object():
    """Without `default: {}` on a section the API server applies none of its defaults, and
    the spec-level CEL rules that read e.g. self.resources.nodes refuse a minimal spec."""
    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    required = set(spec["required"])
    assert required == {"model", "data", "storage"}
    for name, node in spec["properties"].items():
        if node.get("type") == "object" and name not in required:
            assert node.get("default") == {}, name
    training = spec["properties"]["training"]["properties"]
    assert training["optim"]["default"] == {} and training["lora"]["default"] == {}


def test_operator_env_is_reserved():
    """Every variable the operator sets on a trainer pod is one the API server refuses in
    spec.resources.env (a user's value would silently break the rendezvous or storage)."""
    from sftjob_operator import builders
    from tests.operator.op_testkit import job_body

    body = job_body({"storage.region": "eu-west-1"})
    pod = builders.build_pod(builders.JobRef.from_body(body), builders.parse_spec(body["spec"]), 0, 0)
    ours = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    reserved = set(resources.RESERVED_ENV)
    credentials = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}  # refused as credentials instead
    for name in ours - credentials:
        assert name in reserved or name.startswith(resources.RESERVED_ENV_PREFIX), name


def test_rules_of_a_defaulted_section_hold_for_its_default():
    """The API server checks each CEL rule of an object against that object's default ({}
    for the sections a minimal spec leaves out) and refuses the whole CRD when a rule reads a
    field the default lacks. A rule there must guard every field it reads with has()."""
    import re

    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    bad = []
    for path, node in _walk(schema):
        if not isinstance(node, dict) or "default" not in node or node.get("type") != "object":
            continue
        present = set(node["default"] or {})
        for rule in node.get("x-kubernetes-validations", []):
            for field in set(re.findall(r"\bself\.(\w+)", rule["rule"])) - present:
                if f"has(self.{field})" not in rule["rule"]:
                    bad.append(f"{path}: {rule['rule']} reads self.{field} unguarded")
    assert not bad, "\n".join(bad)
