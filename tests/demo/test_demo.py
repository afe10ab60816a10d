"""`make demo`, shortened (DEMO_STEPS), on the local cluster: the SFTJob succeeds after one
preemption, the exported model in S3 loads, Prometheus has the trainer's loss and the
operator's restart counter, and every PromQL query of the chart's Grafana dashboard returns
data from the demo's Prometheus.

The demo runs once per module in its own namespaces, Helm release and Prometheus port, so a
`make demo` left running on the same cluster is untouched; everything it installed is
removed afterwards (helm uninstall, namespaces, the CRD restored to crds/ as other suites
expect it). Prometheus is installed by the demo when missing (apt); if that fails the test
fails: it is never skipped.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from demo import prom as promlib

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "sftjob-operator" / "dashboards" / "sftjob.json"
CRD_SOURCE = REPO / "crds" / "sftjob.io_sftjobs.yaml"
EXAMPLE = yaml.safe_load((REPO / "examples" / "sftjob.yaml").read_text())
EXAMPLE_STEPS = EXAMPLE["spec"]["training"]["totalTrainingSteps"]
STEPS = int(os.environ.get("DEMO_TEST_STEPS", str(EXAMPLE_STEPS)))

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(2400)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(cluster, tmp_path_factory):
    suffix = uuid.uuid4().hex[:6]
    ns, system_ns, release = f"demo-{suffix}", f"demo-system-{suffix}", f"demo-{suffix}"
    workdir = tmp_path_factory.mktemp("demo")
    port = _free_port()
    env = {**os.environ, "DEMO_STEPS": str(STEPS), "DEMO_NAMESPACE": ns, "DEMO_SYSTEM_NAMESPACE": system_ns,
           "DEMO_RELEASE": release, "DEMO_DIR": str(workdir), "DEMO_PROMETHEUS_PORT": str(port),
           "DEMO_KEEP_PROMETHEUS": "1", "DEMO_TIMEOUT": "1200"}
    prom = promlib.Prometheus(workdir / "prometheus", port)
    try:
        proc = subprocess.run([sys.executable, "-m", "demo.run"], env=env, capture_output=True,
                              text=True, timeout=2000, cwd=REPO)
        print(proc.stdout[-6000:])
        summary_path = workdir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        yield {"proc": proc, "summary": summary, "prom": prom, "ns": ns, "system_ns": system_ns,
               "release": release}
    finally:
        prom.stop()
        cluster.helm("uninstall", release, "-n", system_ns, "--wait", "--timeout", "120s", check=False)
        for name in (ns, system_ns):
            cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)
        # The release adopted the cluster-wide CRD; give it back as crds/ has it (replace, so
        # that Helm's ownership labels go too), as tests/chart does after its installs; but
        # not when another release has adopted it since (a concurrent run on a shared cluster).
        crd = cluster.kubectl("get", "crd", "sftjobs.sftjob.io", "-o", "json", check=False)
        owner = json.loads(crd.stdout or "{}").get("metadata", {}).get("annotations", {}).get(
            "meta.helm.sh/release-name") if crd.returncode == 0 else None
        if owner == release:
            cluster.kubectl("replace", "-f", str(CRD_SOURCE), check=False)


def _output(d) -> str:
    p = d["proc"]
    return f"rc={p.returncode}\n--- stdout ---\n{p.stdout[-8000:]}\n--- stderr ---\n{p.stderr[-4000:]}"


def test_demo_runs_end_to_end(demo, cluster):
    proc, s = demo["proc"], demo["summary"]
    assert proc.returncode == 0, _output(demo)
    for n in range(1, 8):
        assert f"==> [{n}/7]" in proc.stdout, f"stage {n} not announced\n{_output(demo)}"
    assert s["phase"] == "Succeeded", s
    assert s["restarts"]["preemptions"] == 1 and s["restarts"]["failures"] == 0, s["restarts"]
    assert s["progress"]["step"] == STEPS
    # The gang resumed from a committed checkpoint, not from scratch.
    assert s["preemption"]["resume_step"] >= s["preemption"]["checkpoint_step"] > 0, s["preemption"]
    # ... mid-run: the restarted gang still had steps to train (an eviction after the last
    # step would show neither preemption nor resume at work).
    assert s["preemption"]["resume_step"] < STEPS, s["preemption"]
    assert "resumed from" in s["resume_line"]
    if STEPS == EXAMPLE_STEPS:  # the example's whole run: the prompts shown are answered (as test_demo_answers checks)
        assert all(g["correct"] for g in s["generations"]), s["generations"]


def test_the_run_is_in_tensorboard_every_step_once_across_the_preemption(demo):
    """Issue 27: the demo shows where to look. Its job logs to TensorBoard; the event files the
    trainer published to S3 hold train/loss at every step exactly once, though the gang was
    preempted and resumed, and the validation losses."""
    tb = demo["summary"].get("tensorboard")
    assert tb, demo["proc"].stdout[-3000:]
    assert tb["train_loss_steps"] == list(range(1, STEPS + 1)), tb
    assert len(tb["files"]) >= 2, "one event file per attempt: the preempted attempt's steps are in the first"
    assert tb["val_loss_steps"] and "train/lr" in tb["tags"], tb
    assert "tensorboard --logdir" in demo["proc"].stdout


def test_pods_run_the_locally_built_images_as_their_non_root_users(demo):
    """The operator's and the trainer's pods run from the images `make images` built here (the
    image ID the runtime reports is the built image's), as the images' non-root users."""
    from hack.localcluster import images

    built = images.build(("operator", "trainer"))
    pods = demo["summary"]["pods"]
    for name, uid in (("operator", "65532"), ("trainer", "1000")):
        assert pods[name]["uid"] == uid, pods[name]
        assert pods[name]["image"].endswith(built[name].ref.split("/", 1)[1]), (pods[name], built[name].ref)
        assert pods[name]["imageID"].split(":")[-1] == built[name].image_id.split(":")[-1], (pods[name], built[name])
    # The trainer image carries sftjob's CPU attention kernel prebuilt (it has no C compiler to
    # build one), and its rank 0 ran it where the CPU can (AVX2 and FMA: this project's machines).
    from sftjob_trainer.cpu_attention import why_not
    from sftjob_trainer.cpu_blas import read_cpu

    line = demo["summary"].get("attention_line") or ""
    reason = why_not(read_cpu())
    if reason is None:
        assert "sftjob's causal kernel" in line and "sftjob_trainer/libsftjob_cpu_attention.so" in line, line
    else:
        assert reason in line, line


def test_exported_model_in_s3_loads(demo, cluster, tmp_path):
    s = demo["summary"]
    uri = s.get("output_uri") or ""
    assert uri.startswith("s3://") and uri.endswith("/hf/final"), s
    bucket, key = uri[len("s3://"):].split("/", 1)
    s3 = cluster.s3()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        for o in page.get("Contents", []):
            dest = tmp_path / o["Key"][len(key) + 1:]
            dest.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, o["Key"], str(dest))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(tok)
    assert s["model_loads"] is True and s["generation"]["fine_tuned"] is not None


def test_prometheus_has_trainer_loss_and_operator_restarts(demo):
    s, prom = demo["summary"], demo["prom"]
    assert prom.pid(), "the demo did not leave Prometheus running (DEMO_KEEP_PROMETHEUS)"
    window = s["prometheus"]["start"], s["prometheus"]["end"]
    loss = prom.query_range(f'sftjob_trainer_loss{{namespace="{demo["ns"]}",sftjob="tiny-lora"}}', *window)
    assert loss and any(float(v) > 0 for series in loss for _, v in series["values"]), loss
    restarts = prom.query(f'sftjob_operator_gang_restarts_total{{namespace="{demo["system_ns"]}"}}', at=window[1])
    assert restarts, "no series for the operator's restart counter"
    by_cause = {r["metric"]["cause"]: float(r["value"][1]) for r in restarts}
    assert by_cause == {"preemption": 1.0}, by_cause
    assert s["prometheus"]["restarts_by_cause"] == {"preemption": 1}
    # Gauges read NaN before a rank's first step; the summary must average measured values only.
    tps = s["prometheus"]["tokens_per_second_mean"]
    assert tps is not None and math.isfinite(tps) and tps > 0, tps


def _dashboard_params():
    return [pytest.param(title, expr, id=title) for title, expr in promlib.dashboard_queries(DASHBOARD)]


@pytest.mark.parametrize("title,expr", _dashboard_params())
def test_dashboard_query_returns_data(demo, title, expr):
    s, prom = demo["summary"], demo["prom"]
    assert "prometheus" in s, _output(demo)
    q = promlib.grafana_expand(expr, {"sftjob": "tiny-lora", "datasource": "prometheus"})
    series = prom.query_range(q, s["prometheus"]["start"], s["prometheus"]["end"], step=2)
    assert series, f"panel {title!r}: {q} returned no data"


# Panels the issue asks for that the chart's dashboard does not have yet (proposed to its
# owner); checked here so that the proposal is known to work.
PROPOSED = {
    "Checkpoint age (steps)":
        'sftjob_trainer_step{sftjob=~"$sftjob"} - sftjob_trainer_last_checkpoint_step{sftjob=~"$sftjob"}',
}


@pytest.mark.parametrize("title,expr", list(PROPOSED.items()), ids=list(PROPOSED))
def test_proposed_panel_query_returns_data(demo, title, expr):
    s, prom = demo["summary"], demo["prom"]
    q = promlib.grafana_expand(expr, {"sftjob": "tiny-lora"})
    assert prom.query_range(q, s["prometheus"]["start"], s["prometheus"]["end"], step=2), q
