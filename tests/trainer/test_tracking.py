"""Experiment tracking against the real components (issue 27, item 1).

One training job, stopped in the middle and resumed, logs to all three backends at once: a
real MLflow tracking server (the `mlflow` package, sqlite store), TensorBoard event files
(read back with TensorBoard's own EventAccumulator) and W&B in offline mode (read back from
its run files). The first attempt checkpoints at step 3 and dies after step 5, having logged
steps 1..5; the second resumes from step 3 and trains 4..10 again. Each backend must hold
every step exactly once, in one run, with the values the run computed.
"""
from __future__ import annotations

import json
import logging
import socket
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from sftjob_contract.config import load_config
from sftjob_contract.tracking import MlflowConfig
from sftjob_trainer import tracking
from sftjob_trainer.track_mlflow import Mlflow
from sftjob_trainer.track_wandb import history, records, run_id

from . import inproc, mlflow_server, runner

pytestmark = pytest.mark.unit

CRASH_AFTER, TOTAL, SAVE_FREQ, TEST_FREQ = 5, 10, 3, 2
EXPERIMENT, RUN_NAME = "team-a", "tiny"


class Crash(Exception):
    """The first attempt's end: after step CRASH_AFTER, past its last checkpoint (step 3)."""


@dataclass
class Scenario:
    url: str
    out: Path
    final: str
    wandb_dir: Path
    losses: dict[int, float]       # step -> training loss, as metrics.jsonl has it
    val_losses: dict[int, float]
    identity: str


def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    """step -> value; a step trained twice (before and after the resume) must have had one value."""
    out: dict[int, float] = {}
    for r in rows:
        if key in r:
            assert out.setdefault(r["step"], r[key]) == pytest.approx(r[key], rel=1e-6), (key, r["step"])
    return out


@pytest.fixture(scope="module")
def tracked(assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracking")
    out, wandb_dir = tmp / "out", tmp / "wandb"
    wandb_dir.mkdir()
    with mlflow_server.serve(tmp / "mlflow") as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(wandb_dir))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        args = runner.base_args(assets, out, **{
            "data.val_files": assets / "data" / "val.parquet", "trainer.total_training_steps": TOTAL,
            "trainer.save_freq": SAVE_FREQ, "trainer.test_freq": TEST_FREQ,
            "tracking.tensorboard": "true", "tracking.mlflow.tracking_uri": url,
            "tracking.mlflow.experiment": EXPERIMENT, "tracking.mlflow.run_name": RUN_NAME,
            "tracking.mlflow.credentials_secret": "mlflow-credentials",
            "tracking.wandb.mode": "offline", "tracking.wandb.project": EXPERIMENT})
        with inproc.trainer(args) as first:
            train_step = first._train_step

            def step_then_crash(*a):
                train_step(*a)
                if first.state.step == CRASH_AFTER:
                    raise Crash

            first._train_step = step_then_crash
            with pytest.raises(Crash):
                first.train()
        with inproc.trainer(args) as second:
            assert second.state.step == SAVE_FREQ, "the second attempt must resume from the checkpoint"
            final = second.train()
        rows = runner.read_metrics(out)
        yield Scenario(url, out, final, wandb_dir, _by_step(rows, "loss"), _by_step(rows, "val_loss"),
                       tracking.run_info(load_config(None, args)).identity)


def test_the_scenario_trains_steps_again_after_the_resume(tracked):
    steps = [r["step"] for r in runner.read_metrics(tracked.out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10], "steps 4 and 5 must be trained (and offered) twice"


# --------------------------------------------------------------------------- TensorBoard


def test_tensorboard_files_in_the_output_dir_hold_every_step_once(tracked):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

    logdir = tracked.out / "tensorboard"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2, "one event file per attempt, in one directory"
    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0, TENSORS: 0}, purge_orphaned_data=False)
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in loss] == list(range(1, TOTAL + 1)), "every step exactly once across the resume"
    assert [v for _, v in loss] == pytest.approx([tracked.losses[s] for s in range(1, TOTAL + 1)], rel=1e-5)
    val = [(e.step, e.value) for e in acc.Scalars("val/loss")]
    assert val == [(s, pytest.approx(tracked.val_losses[s], rel=1e-5)) for s in range(TEST_FREQ, TOTAL + 1, TEST_FREQ)]
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, TOTAL + 1)), tag
    assert "params/text_summary" in acc.Tags()[TENSORS], "the parameters, once"


# --------------------------------------------------------------------------- MLflow


def _mlflow(url: str, endpoint: str, body: dict | None = None, **query) -> dict:
    full = f"{url}/api/2.0/mlflow/{endpoint}" + ("?" + urllib.parse.urlencode(query) if query else "")
    req = urllib.request.Request(full, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


def test_mlflow_has_one_run_for_the_job_with_every_step_once(tracked):
    experiment = _mlflow(tracked.url, "experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
    runs = _mlflow(tracked.url, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    assert len(runs) == 1, "both attempts must log into one run"
    run = runs[0]
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == RUN_NAME
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["output_uri"] == tracked.final and tags["sftjob.identity"] == tracked.identity
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["optim.lr"] == "0.003" and params["trainer.save_freq"] == str(SAVE_FREQ)
    assert params["tracking.mlflow.experiment"] == EXPERIMENT
    assert not [k for k in params if "secret" in k], "Secret names are not parameters"

    def series(key: str) -> list[tuple[int, float]]:
        got = _mlflow(tracked.url, "metrics/get-history", run_id=run["info"]["run_id"], metric_key=key)["metrics"]
        return sorted((m["step"], m["value"]) for m in got)

    loss = series("train/loss")
    assert [s for s, _ in loss] == list(range(1, TOTAL + 1)), "every step exactly once across the resume"
    assert [v for _, v in loss] == pytest.approx([tracked.losses[s] for s in range(1, TOTAL + 1)], rel=1e-9)
    assert series("val/loss") == [(s, pytest.approx(tracked.val_losses[s], rel=1e-9))
                                  for s in range(TEST_FREQ, TOTAL + 1, TEST_FREQ)]
    assert [s for s, _ in series("train/grad_norm")] == list(range(1, TOTAL + 1))


def test_an_mlflow_server_that_is_down_costs_no_training_and_catches_up(tracked, caplog):
    errors = []
    hung = socket.socket()   # a server that takes the connection and never answers: each call times out
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    backend = Mlflow(MlflowConfig(tracking_uri=f"http://127.0.0.1:{hung.getsockname()[1]}", experiment="down"))
    run = tracking.RunInfo(identity="down-then-up", output_dir="/x", name="down")
    with caplog.at_level(logging.WARNING, logger=tracking.__name__):
        tracker = tracking.Tracker([backend], run, {"a": "1"}, count_error=lambda: errors.append(1))
        t0 = time.monotonic()
        for step in (1, 2, 3):
            tracker.log(step, {"loss": 1.0 / step})   # nothing listens: never raises, never waits
        assert time.monotonic() - t0 < 0.5, "the training loop waited for the tracking server"
        tracker.wait(30)
    assert errors and len([r for r in caplog.records if "failed" in r.message]) == 1, "warned once"
    backend.rest.base = f"{tracked.url}/api/2.0/mlflow/"    # the server is back
    time.sleep(tracking.MAX_BACKOFF_S if len(errors) > 6 else 2.0 ** (len(errors) - 1) + 0.1)
    tracker.log(4, {"loss": 0.25})
    tracker.finish("s3://b/out/hf/final")
    experiment = _mlflow(tracked.url, "experiments/get-by-name", experiment_name="down")["experiment"]
    runs = _mlflow(tracked.url, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    history = _mlflow(tracked.url, "metrics/get-history", run_id=runs[0]["info"]["run_id"], metric_key="train/loss")
    assert sorted(m["step"] for m in history["metrics"]) == [1, 2, 3, 4], "the rows kept while down arrive"
    hung.close()


# --------------------------------------------------------------------------- W&B


def test_wandb_offline_run_is_resumed_by_the_job_id_with_every_step_once(tracked):
    rid = run_id(tracking.RunInfo(tracked.identity, "", ""))
    files = sorted((tracked.wandb_dir / "wandb").glob(f"offline-run-*-{rid}/run-{rid}.wandb"))
    assert len(files) == 2, "one offline directory per attempt, both under the job's run id"
    rows = [(step, row) for f in files for step, row in history(f)]
    assert [s for s, r in rows if "train/loss" in r] == list(range(1, TOTAL + 1)), "every step exactly once"
    assert [json.loads(r["train/loss"]) for _, r in rows if "train/loss" in r] == pytest.approx(
        [tracked.losses[s] for s in range(1, TOTAL + 1)], rel=1e-9)
    assert [s for s, r in rows if "val/loss" in r] == list(range(TEST_FREQ, TOTAL + 1, TEST_FREQ))
    summary = {i.key: i.value_json for r in records(files[-1]) if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update}
    assert json.loads(summary["output_uri"]) == tracked.final


# --------------------------------------------------------------------------- parameters


def test_parameters_are_the_resolved_config_without_secret_names(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}", f"data.train_files={tmp_path}/t.parquet",
                             f"trainer.output_dir={tmp_path}/out", "tracking.mlflow.tracking_uri=http://m:5000",
                             "tracking.mlflow.credentials_secret=mlflow-creds", "tracking.wandb.api_key_secret=wb"])
    got = tracking.params(cfg)
    assert got["optim.lr"] == str(cfg.optim.lr) and got["tracking.mlflow.tracking_uri"] == "http://m:5000"
    assert "mlflow-creds" not in got.values() and "wb" not in got.values()


def test_tensorboard_publishes_to_the_store_at_commit_and_a_new_pod_reads_what_was_published(tmp_path):
    """An s3:// output in miniature (a store with scratch space: written locally, published by
    copy): what a pod logged after its last commit is lost with the pod, and the next pod's
    start answers the last published step, so it logs those steps again and nothing twice."""
    from sftjob_trainer.storage import LocalDir
    from sftjob_trainer.track_tensorboard import TensorBoard, last_steps

    root = tmp_path / "store"
    run = tracking.RunInfo("id", str(root), "job")
    first = TensorBoard(LocalDir(root, tmp_path / "pod-1"))
    assert first.start(run, {"a": "1"}) == {}
    for step in (1, 2, 3):
        first.log(step, {"train/loss": 1.0 / step})
    first.commit()
    first.log(4, {"train/loss": 0.25})     # never committed: the pod is lost with it
    second = TensorBoard(LocalDir(root, tmp_path / "pod-2"))
    assert second.start(run, {"a": "1"}) == {"train/loss": 3}
    second.log(4, {"train/loss": 0.25})
    second.finish("FINISHED", None)
    assert last_steps(root / "tensorboard") == {"train/loss": 4}
    assert len(list((root / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_a_backend_that_never_starts_is_given_up_after_bounded_tries(monkeypatch):
    """Each try may cost a connect timeout: an unreachable server is not retried for ever."""
    calls = []

    class Unreachable:
        name = "unreachable"

        def start(self, run, params):
            calls.append(1)
            raise ConnectionRefusedError("nothing listens")

    monkeypatch.setattr(tracking, "MAX_BACKOFF_S", 0.0)   # every try is due at once
    tracker = tracking.Tracker([Unreachable()], tracking.RunInfo("id", "/x", "job"), {})
    for step in range(1, 50):
        tracker.log(step, {"loss": 1.0})
    tracker.finish("/x/hf/final")
    assert len(calls) == tracking.MAX_START_TRIES and tracker.backends == []
