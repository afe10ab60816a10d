"""Non-finite training fails loudly.

Before, a step with a non-finite loss or gradient norm was skipped with no limit: a model
whose weights are NaN trained every step at loss=nan, exited 0 and exported its NaN
weights, and the loss metric kept showing the last finite value. Now
`trainer.max_non_finite_steps` skipped steps in a row, or a run in which no step was
finite, end with NonFiniteLoss (exit 2) and nothing is exported.

The runs go through `cli.run`, in this process, as the pod's entry point does after parsing.
"""
from __future__ import annotations

import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from sftjob_contract import env as E
from sftjob_contract import exits
from sftjob_contract.config import load_config
from sftjob_trainer import cli
from tools.assets import make_rows, write_parquet

from . import runner

pytestmark = pytest.mark.unit

POISON = "<|system|>"  # a token the single-turn rows never hold, so its embedding is used only where put


def model_with_nan(assets, dest, token_id: int | None = None):
    """The tiny model with NaN weights: one layer's whole projection, or one token's embedding row."""
    shutil.copytree(assets / "model", dest)
    weights = load_file(dest / "model.safetensors")
    if token_id is None:
        weights["model.layers.0.mlp.down_proj.weight"].fill_(float("nan"))
    else:
        weights["model.embed_tokens.weight"][token_id] = float("nan")
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def run(assets, tmp_path, monkeypatch, model, **over) -> tuple[int, str]:
    out = tmp_path / "out"
    termination = tmp_path / "termination-log"
    monkeypatch.setenv(E.TERMINATION_LOG, str(termination))
    args = runner.base_args(assets, out, **{"model.path": model, **over})
    code = cli.run(load_config(None, args))
    return code, termination.read_text().strip() if termination.exists() else ""


def steps(tmp_path) -> list[dict]:
    return runner.read_metrics(tmp_path / "out")


def test_a_model_with_nan_weights_fails_with_non_finite_loss_and_exports_nothing(assets, tmp_path, monkeypatch):
    model = model_with_nan(assets, tmp_path / "nan-model")
    code, message = run(assets, tmp_path, monkeypatch, model, **{"trainer.total_training_steps": 10})
    assert code == exits.PERMANENT, message
    assert message.startswith(f"{exits.REASON_NON_FINITE_LOSS}: 5 optimizer steps in a row"), message
    assert "spec.training.maxNonFiniteSteps=5" in message and "spec.model.path" in message
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], "the run must stop at the limit"
    assert all(math.isnan(r["loss"]) for r in rows), "a non-finite loss is shown as such"
    assert not (tmp_path / "out" / "hf").exists(), "a NaN model was exported"


@pytest.mark.parametrize("limit", [5, 0], ids=["shorter-than-the-limit", "no-limit"])
def test_a_run_without_a_single_finite_step_fails(assets, tmp_path, monkeypatch, limit):
    model = model_with_nan(assets, tmp_path / "nan-model")
    code, message = run(assets, tmp_path, monkeypatch, model,
                        **{"trainer.total_training_steps": 4, "trainer.max_non_finite_steps": limit})
    assert code == exits.PERMANENT, message
    assert message.startswith(f"{exits.REASON_NON_FINITE_LOSS}: no optimizer step of this run had a finite "), message
    assert len(steps(tmp_path)) == 4 and not (tmp_path / "out" / "hf").exists()


def poisoned(assets, tmp_path, pattern: str):
    """Training rows in file order, one global batch (8 rows) per character of ``pattern``:
    P puts the poisoned token in every prompt of the batch, C leaves it clean."""
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(assets / "model").convert_tokens_to_ids(POISON)
    rows = make_rows(8 * len(pattern), seed=7)
    for i, row in enumerate(rows):
        if pattern[i // 8] == "P":
            row["prompt"] = f"{POISON} {row['prompt']}"
    write_parquet(rows, tmp_path / "poisoned.parquet")
    return model_with_nan(assets, tmp_path / "poison-model", token_id), tmp_path / "poisoned.parquet"


def test_a_finite_step_resets_the_count_and_nan_weights_are_never_exported(assets, tmp_path, monkeypatch):
    """Two skipped steps, a finite one, two more, ...: never three in a row, so all eight steps
    train; the NaN embedding row the data rarely reaches is still refused at export."""
    model, data = poisoned(assets, tmp_path, "PPCPPCPP")
    code, message = run(assets, tmp_path, monkeypatch, model, **{
        "data.train_files": data, "data.shuffle": False, "trainer.total_training_steps": 8,
        "trainer.max_non_finite_steps": 3})
    assert pattern_of(steps(tmp_path)) == "PPCPPCPP", message
    assert code == exits.PERMANENT, message
    assert message.startswith(f"{exits.REASON_NON_FINITE_LOSS}: the trained weights hold NaN or inf values "
                              "(model.embed_tokens.weight)"), message
    assert not (tmp_path / "out" / "hf").exists(), "a NaN model was exported"


def test_the_limit_counts_non_finite_steps_in_a_row(assets, tmp_path, monkeypatch):
    model, data = poisoned(assets, tmp_path, "PPCPPPCC")
    code, message = run(assets, tmp_path, monkeypatch, model, **{
        "data.train_files": data, "data.shuffle": False, "trainer.total_training_steps": 8,
        "trainer.max_non_finite_steps": 3})
    assert code == exits.PERMANENT, message
    assert message.startswith(f"{exits.REASON_NON_FINITE_LOSS}: 3 optimizer steps in a row, up to step 6,"), message
    assert pattern_of(steps(tmp_path)) == "PPCPPP"
    assert not (tmp_path / "out" / "hf").exists()


def pattern_of(rows: list[dict]) -> str:
    return "".join("C" if math.isfinite(r["loss"]) else "P" for r in rows)


def test_the_loss_metric_shows_a_non_finite_loss_instead_of_the_last_finite_one(tmp_path):
    from sftjob_trainer.metrics import Metrics

    from .test_metrics import free_port, scrape

    port = free_port()
    m = Metrics(tmp_path / "metrics.jsonl", port)
    try:
        m.record(step=1, loss=2.5, grad_norm=0.7, tokens_per_s=60.0)
        m.record(step=2, loss=float("nan"), grad_norm=float("inf"), tokens_per_s=float("nan"))
        m.count(skipped=1)
        seen = scrape(port)
    finally:
        m.close()
    assert seen["sftjob_trainer_step"] == 2 and math.isnan(seen["sftjob_trainer_loss"])
    assert seen["sftjob_trainer_grad_norm"] == float("inf") and seen["sftjob_trainer_skipped_steps_total"] == 1
    assert seen["sftjob_trainer_tokens_per_second"] == 60.0  # a rate is only ever a measurement or unset
