"""The Argo CD health check, kstatus and the Flux health expressions on the statuses the
operator's planner writes (integrations/, hack/tools/health): no cluster, the harness binary."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from .health_kit import CHECK_DIR, REPO, TESTDATA, evaluate, run, summary

pytestmark = [pytest.mark.unit, pytest.mark.built]  # the harness, from hack/build-binaries.sh
README = REPO / "integrations" / "argocd" / "README.md"


def documented_mapping() -> dict[str, tuple[str, str, str]]:
    """The mapping table of integrations/argocd/README.md: testdata file -> (Argo CD, kstatus, Flux)."""
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\|\s*`testdata/([\w-]+)\.yaml`\s*\|[^|]*\|\s*(\w+)\s*\|\s*(\w+)\s*\|\s*(\w+)\s*\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_argo_check_passes_its_own_health_test_yaml_in_both_argo_modes():
    proc = run("argo-test", str(CHECK_DIR))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tests = yaml.safe_load((CHECK_DIR / "health_test.yaml").read_text())["tests"]
    assert proc.stdout.count("ok ") == 2 * len(tests) == 2 * len(list(TESTDATA.glob("*.yaml")))


def test_harness_fails_on_a_wrong_expectation(tmp_path):
    check = tmp_path / "SFTJob"
    shutil.copytree(CHECK_DIR, check)
    text = (check / "health_test.yaml").read_text()
    (check / "health_test.yaml").write_text(text.replace("status: Degraded", "status: Healthy", 1))
    proc = run("argo-test", str(check))
    assert proc.returncode == 1
    assert "FAIL testdata/failed.yaml (built-in): got Degraded" in proc.stdout


def test_a_script_from_argocd_cm_runs_without_the_string_library(tmp_path):
    """Argo CD runs an argocd-cm health script without the standard libraries unless the
    override sets useOpenLibs; the harness must catch a script that needs them."""
    check = tmp_path / "SFTJob"
    shutil.copytree(CHECK_DIR, check)
    (check / "health_test.yaml").write_text(yaml.safe_dump({"tests": [
        {"healthStatus": {"status": "Progressing", "message": "phase Pending"},
         "inputPath": "testdata/pending.yaml"}]}))
    (check / "health.lua").write_text(
        'return {status = "Progressing", message = string.format("phase %s", obj.status.phase)}\n')
    proc = run("argo-test", str(check))
    assert proc.returncode == 1
    assert 'ok   testdata/pending.yaml (built-in): Progressing "phase Pending"' in proc.stdout
    assert "FAIL testdata/pending.yaml (argocd-cm)" in proc.stdout


def test_recorded_statuses_map_as_documented():
    table = documented_mapping()
    assert sorted(table) == sorted(p.stem for p in TESTDATA.glob("*.yaml"))
    got = {name: summary(evaluate(TESTDATA / f"{name}.yaml")) for name in table}
    assert got == table


def test_failure_messages_reach_argo_cd():
    result = evaluate(TESTDATA / "invalid-spec.yaml")
    assert result["argo"]["message"].startswith("InvalidSpec: spec.data.trainBatchSize (3) must be")


@pytest.mark.parametrize("flux_entry", ["current: \"status.phase ==\"", "current: \"\""])
def test_a_broken_flux_expression_is_an_error_not_a_status(tmp_path, flux_entry):
    exprs = tmp_path / "exprs.yaml"
    exprs.write_text(f"- apiVersion: sftjob.io/v1alpha1\n  kind: SFTJob\n  {flux_entry}\n")
    proc = run("flux", str(exprs), str(TESTDATA / "running.yaml"))
    assert proc.returncode == 1 and "current" in proc.stderr


def test_testdata_is_what_the_operator_writes_today():
    proc = subprocess.run([sys.executable, str(REPO / "hack" / "tools" / "health" / "record.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_argocd_cm_snippet_in_the_chart_docs_is_the_script():
    text = (REPO / "charts" / "sftjob-operator" / "README.md").read_text()
    block = text.split("resource.customizations.health.sftjob.io_SFTJob: |\n", 1)[1].split("```", 1)[0]
    snippet = yaml.safe_load("k: |\n" + block)["k"]
    assert snippet == (CHECK_DIR / "health.lua").read_text()
