"""The operator's "checkpoint now" request (trainer/sftjob_trainer/control.py): rank 0's
endpoint, and a 2-rank run that checkpoints on request, holds, and then either trains on
(no stop came) or stops on SIGTERM without a step or a checkpoint more."""
from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families
from sftjob_contract import metrics as M

from sftjob_trainer import control

from . import runner


def _post(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.unit
def test_requests_coalesce_and_the_hold_is_bounded():
    r = control.Requests()
    assert r.take() is None
    assert r.ask(5) == 5 and r.ask(2) == 5      # a pending request keeps the longer hold
    assert r.take() == 5 and r.take() is None   # taken once
    assert r.ask(10 * control.MAX_HOLD_S) == control.MAX_HOLD_S and r.take() == control.MAX_HOLD_S
    assert r.ask(-3) == 0


@pytest.mark.unit
def test_the_endpoint_serves_metrics_and_takes_a_request():
    registry = CollectorRegistry()
    Gauge(M.STEP, "step", registry=registry).set(7)
    requests = control.Requests()
    requests.step = 7
    port = runner.free_port()
    server = control.serve(port, registry, requests)
    try:
        assert _gauges(port)[M.STEP] == 7
        code, body = _post(f"http://127.0.0.1:{port}/checkpoint?holdSeconds=30")
        assert code == 202 and body == {"step": 7, "holdSeconds": 30.0}
        assert requests.take() == 30
        code, body = _post(f"http://127.0.0.1:{port}/checkpoint?holdSeconds=soon")
        assert code == 400 and "holdSeconds" in body["error"] and requests.take() is None
        code, _ = _post(f"http://127.0.0.1:{port}/other")
        assert code == 404
    finally:
        server.shutdown()


def _wait(what, until, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended while waiting for {what}:\n{proc.stdout.read()}")
        try:
            got = until()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}:\n{proc.communicate()[0]}")


@pytest.mark.distributed
def test_a_requested_checkpoint_holds_then_trains_on_or_stops_without_another(assets, tmp_path):
    """2 ranks, no periodic checkpoint, a run too long to end by itself. A request with a 1 s hold
    checkpoints the current step, holds, and training goes on; a second request with a long hold checkpoints again
    and holds: no step is trained while holding, and the SIGTERM then writes nothing more
    (the stop found its step committed) and exits 143."""
    port = runner.free_port()
    out = tmp_path / "out"
    args = runner.base_args(assets, out, **{"trainer.total_training_steps": 100000, "trainer.log_freq": 1,
                                            "data.micro_batch_size_per_gpu": 2, "trainer.metrics_port": port})
    proc = subprocess.Popen(runner.command(args, 2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=runner.env())
    try:
        _wait("step 2", lambda: len(runner.read_metrics(out)) >= 2, proc)
        assert _post(f"http://127.0.0.1:{port}/checkpoint?holdSeconds=1")[0] == 202
        first = _wait("the first requested checkpoint", lambda: sorted(
            int(p.parent.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*/COMMITTED")), proc)
        # the short hold ends and training goes on past the checkpoint
        _wait("training after the hold", lambda: _gauges(port)[M.STEP] >= first[-1] + 2, proc)
        assert _gauges(port)[M.HOLDING] == 0

        assert _post(f"http://127.0.0.1:{port}/checkpoint?holdSeconds=300")[0] == 202
        held = _wait("the hold", lambda: (g := _gauges(port))[M.HOLDING] == 1 and g, proc)
        step = int(held[M.STEP])
        assert held[M.LAST_CHECKPOINT_STEP] == step > first[-1]
        assert (out / "checkpoints" / f"step-{step}" / "COMMITTED").exists()
        time.sleep(2.0)
        assert _gauges(port)[M.STEP] == step, "a step was trained while holding"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            runner.kill_tree(proc.pid)
    assert proc.returncode == 143, output
    assert "committed on request" in output
    committed = sorted(int(p.parent.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*/COMMITTED"))
    assert committed[-1] == step, (committed, output)          # the stop wrote no checkpoint after the hold
    assert max(r["step"] for r in runner.read_metrics(out) if "loss" in r) == step
