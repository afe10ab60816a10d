"""The prompts `make demo` shows are answered correctly by the model its job trains.

The example's settings (examples/sftjob.yaml, turned into a trainer config by the operator's
own builders.trainer_config) train here in one process on the same tiny assets, and the
demo's stage-5 code (demo.inference) asks the exported model the prompts the demo prints.
The demo trains on 2 ranks with the same global batch; this is its arithmetic on one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from demo import inference
from demo.model import SHOWN_PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _local_config(assets: Path, out: Path) -> dict:
    from sftjob_operator import builders

    spec = builders.parse_spec(yaml.safe_load((REPO / "examples" / "sftjob.yaml").read_text())["spec"])
    cfg = builders.trainer_config(builders.JobRef(name="tiny-lora", namespace="demo", uid="local"), spec)
    cfg["model"]["path"] = str(assets / "model")
    cfg["data"]["train_files"] = [str(assets / "data" / "train.parquet")]
    cfg["data"]["val_files"] = [str(assets / "data" / "val.parquet")]
    cfg["trainer"].update(output_dir=str(out), metrics_port=0)
    return cfg


def test_the_example_job_teaches_the_prompts_the_demo_shows(tmp_path):
    import pyarrow.parquet as pq
    from tools.assets import make_assets

    assets, out = make_assets(tmp_path / "assets"), tmp_path / "run"
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump(_local_config(assets, out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "sftjob_trainer", "--config", str(config)], env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = pq.read_table(assets / "data" / "val.parquet").to_pylist()[:SHOWN_PROMPTS]
    answers = inference.answers(inference.load(assets / "model"), inference.load(out / "hf" / "final"), rows)
    wrong = [a for a in answers if not a.correct]
    assert not wrong, "\n".join(f"{a.prompt!r}: {a.fine_tuned!r}, expected {a.expected!r}" for a in wrong)
