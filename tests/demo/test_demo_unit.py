"""The demo's pure parts: the job manifest it applies, its `kubectl get sft` rows, the
Grafana variable expansion, the scrape targets, and the reference generator
(tools.reference: every CRD field documented)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tools import reference as gen_reference

from demo import job, prom, targets, ui
from demo import run as demo_run

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_manifest_is_the_example_unless_overridden():
    args = demo_run.parse([])
    example = yaml.safe_load((REPO / "examples" / "sftjob.yaml").read_text())
    obj, notes = job.job_manifest(args, None, example["spec"]["storage"]["endpoint"])
    assert obj == example and notes == []


def test_demo_steps_keep_a_checkpoint_and_validation_before_the_end():
    args = demo_run.parse(["--steps", "8"])
    crd = yaml.safe_load((REPO / "crds" / "sftjob.io_sftjobs.yaml").read_text())
    obj, notes = job.job_manifest(args, crd, "http://10.9.0.1:9000")
    t = obj["spec"]["training"]
    assert t["totalTrainingSteps"] == 8 and obj["spec"]["checkpoint"]["interval"] == 4 and t["testFreq"] == 4
    assert obj["spec"]["storage"]["endpoint"] == "http://10.9.0.1:9000"
    if "peakTflops" in job.training_fields(crd):
        assert t["peakTflops"] == job.CPU_PEAK_TFLOPS
    assert len(notes) >= 2
    assert obj["spec"]["tracking"] == {"tensorboard": True}, "the demo shows the run in TensorBoard"


def test_rows_of_separate_kubectl_calls_line_up():
    a = ("NAME        PHASE     STEP   LOSS   RESTARTS   AGE\n"
         "tiny-lora   Pending                 0          2s\n")
    b = ("NAME        PHASE       STEP    LOSS     RESTARTS   AGE\n"
         "tiny-lora   Succeeded   12/12   3.889    1          3m9s\n")
    head, r1, r2 = ui.row(a, header=True), ui.row(a), ui.row(b)
    for col in ("PHASE", "STEP", "LOSS", "RESTARTS", "AGE"):
        i = head.index(col)
        assert r2[i - 1] == " " and r2[i] != " ", (col, head, r2)
    assert r1.split() == ["tiny-lora", "Pending", "0", "2s"]
    assert r1.index("0") == head.index("RESTARTS")


def test_rows_keep_columns_apart_whatever_the_reason():
    """`kubectl get sft` has a REASON column whose values (RestartingAfterPreemption) are
    longer than any other cell: rows printed from different calls still line up and never
    run two cells together."""
    a = ("NAME        PHASE      REASON                      STEP    LOSS     RESTARTS   AGE\n"
         "tiny-lora   Restarting RestartingAfterPreemption   10/40   1.2094   1          20s\n")
    b = ("NAME        PHASE     REASON           STEP    LOSS     RESTARTS   AGE\n"
         "tiny-lora   Running   AllPodsRunning   13/40   1.2094   1          34s\n")
    head, r1, r2 = ui.row(a, header=True), ui.row(a), ui.row(b)
    assert r1.split() == ["tiny-lora", "Restarting", "RestartingAfterPreemption", "10/40", "1.2094", "1", "20s"]
    assert r2.split() == ["tiny-lora", "Running", "AllPodsRunning", "13/40", "1.2094", "1", "34s"]
    for col in ("STEP", "LOSS", "RESTARTS", "AGE"):
        assert r1[head.index(col)] != " " and r2[head.index(col)] != " ", (col, head, r1, r2)


def test_grafana_variables_expand_like_an_all_selection():
    e = 'sum by (cause) (increase(x{sftjob=~"$sftjob"}[$__rate_interval])) + y{j=~"${sftjob}"}'
    assert prom.grafana_expand(e, {"sftjob": ".*"}) == \
        'sum by (cause) (increase(x{sftjob=~".*"}[1m])) + y{j=~".*"}'


def test_dashboard_has_the_issue_panels():
    queries = dict(prom.dashboard_queries(REPO / "charts" / "sftjob-operator" / "dashboards" / "sftjob.json"))
    text = " ".join(queries.values())
    for metric in ("sftjob_trainer_loss", "sftjob_trainer_learning_rate", "sftjob_trainer_tokens_per_second",
                   "sftjob_trainer_mfu", "sftjob_trainer_last_checkpoint_step", "sftjob_operator_gang_restarts_total",
                   "sftjob_operator_jobs"):
        assert metric in text, metric


def _fields(schema: dict, path: str):
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        yield from _fields(schema["items"], path + "[]")
        return
    for name, sub in (schema.get("properties") or {}).items():
        yield path, name, sub
        yield from _fields(sub, f"{path}.{name}")


def test_reference_documents_every_crd_field():
    crd = yaml.safe_load(gen_reference.CRD.read_text())
    md = gen_reference.render(crd)
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    missing = []
    for top in ("spec", "status"):
        for path, name, sub in _fields(root[top], top):
            section = md.split(f"#### `{path}`\n", 1)
            if len(section) < 2 or f"| `{name}`" not in section[1].split("\n#### ", 1)[0]:
                missing.append(f"{path}.{name}")
            elif sub.get("description"):
                assert gen_reference._md(sub["description"])[:40] in md
    assert not missing, missing
    assert "#### `kubectl get sft` columns" in md


def test_reference_block_replacement_and_check(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{gen_reference.BEGIN}\nold\n{gen_reference.END}\ntail\n")
    assert gen_reference.main(["--check", str(readme)]) == 1
    assert gen_reference.main(["--write", str(readme)]) == 0
    assert gen_reference.main(["--check", str(readme)]) == 0
    assert readme.read_text().endswith("tail\n") and "#### `spec.model`" in readme.read_text()


def test_trainer_reference_lists_every_key():
    from sftjob_contract.config import SFTConfig

    md = gen_reference.render_trainer()
    for section, field in SFTConfig.model_fields.items():
        assert f"#### `{section}`" in md
        for key in field.annotation.model_fields:
            assert f"| `{key}` |" in md, f"{section}.{key}"


def _pod(name: str, phase: str = "Running", ip: str | None = "10.0.0.5", deleting: bool = False, **labels) -> dict:
    meta = {"name": name, "labels": labels, **({"deletionTimestamp": "now"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip},
            "spec": {"containers": [{"ports": [{"name": "rendezvous", "containerPort": 29500},
                                               {"name": "metrics", "containerPort": 9400}]}]}}


def test_scrape_targets_are_the_running_pods_metrics_ports_labelled_like_the_podmonitor():
    pods = [_pod("j-node-0", **{"sftjob.io/job-name": "j", "sftjob.io/attempt": "1"}),
            _pod("old", deleting=True), _pod("pending", phase="Pending"), _pod("no-ip", ip=None)]
    assert targets.trainer_targets(pods, "ns") == [
        ("10.0.0.5:9400", {"namespace": "ns", "pod": "j-node-0", "sftjob": "j", "attempt": "1"})]
    assert targets.operator_targets(pods[:1], "sys") == [("10.0.0.5:9400", {"namespace": "sys", "pod": "j-node-0"})]
