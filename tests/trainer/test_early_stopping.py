"""Periodic validation, early stopping and export=best (issue 27, item 2).

The data makes the validation loss fall and then rise, deterministically: the training rows
teach one answer per question, the validation rows ask the same questions with another
answer. The loss first falls (the form of the answer is shared), then rises as the model
grows sure of the training answer. Early stopping must end the run `patience` validations
after the lowest loss, and export=best must export the weights of that validation.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sftjob_contract import metrics as M
from sftjob_trainer import early_stop
from tools.assets import CITIES, COLORS, COUNTRIES, FRUITS, write_parquet
from sftjob_trainer.checkpoint import TrainerState

from . import inproc, runner

pytestmark = pytest.mark.unit

PATIENCE, TEST_FREQ = 3, 2


def conflicting_data(tmp_path: Path) -> tuple[Path, Path]:
    def rows(shift: int) -> list[dict]:
        out = [{"prompt": f"what color is the {f} ?", "response": f"the {f} is {COLORS[(i + shift) % len(COLORS)]} ."}
               for i, f in enumerate(FRUITS)]
        return out + [{"prompt": f"what is the capital of {c} ?",
                       "response": f"the capital of {c} is {CITIES[(i + shift) % len(CITIES)]} ."}
                      for i, c in enumerate(COUNTRIES)]

    write_parquet(rows(0)[:24], tmp_path / "train.parquet")
    write_parquet(rows(5), tmp_path / "val.parquet")
    return tmp_path / "train.parquet", tmp_path / "val.parquet"


def args(assets, tmp_path, out, **over) -> list[str]:
    train, val = conflicting_data(tmp_path)
    return runner.base_args(assets, out, **{
        "data.train_files": train, "data.val_files": val, "optim.lr": 1e-2, "trainer.test_freq": TEST_FREQ,
        "trainer.early_stopping_patience": PATIENCE, "trainer.total_training_steps": 200, **over})


def val_loss_of_export(final: Path, val_file: Path) -> float:
    """The validation loss of the exported model, loaded as a user loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sftjob_contract.config import DataConfig
    from sftjob_trainer.batching import eval_batches
    from sftjob_trainer.data import SampleBuilder, SFTDataset
    from sftjob_trainer.loss import ce_sum

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, attn_implementation="sdpa").eval()
    data_cfg = DataConfig(train_files=[str(val_file)], max_length=64)
    val = SFTDataset(data_cfg.train_files, SampleBuilder(tok, data_cfg), "val")
    total = count = 0.0
    with torch.no_grad():
        for mb in eval_batches(val, 8, 0, 1, False, tok.pad_token_id):
            total += ce_sum(model, mb, torch.device("cpu"), "fp32").item()
            count += mb.n_targets
    return total / count


def committed_steps(out: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in (out / "checkpoints").glob("step-*") if (d / "COMMITTED").exists())


def test_validation_loss_rises_the_run_stops_there_and_exports_the_best_weights(assets, tmp_path):
    out, port = tmp_path / "out", runner.free_port()
    # keep_checkpoints=1 and a checkpoint every 3 steps: only the pin keeps the best one alive.
    over = {"trainer.export": "best", "trainer.save_freq": 3, "trainer.keep_checkpoints": 1,
            "trainer.metrics_port": port}
    with inproc.trainer(args(assets, tmp_path, out, **over)) as trainer:
        final = trainer.train()
        seen = inproc.scrape(port)
        reason = early_stop.stopped_early(trainer.cfg.trainer, trainer.state, trainer.total_steps)

    rows = runner.read_metrics(out)
    vals = [r for r in rows if "val_loss" in r]
    losses = [r["val_loss"] for r in vals]
    best_i = losses.index(min(losses))
    best, best_step = losses[best_i], vals[best_i]["step"]
    assert 0 < best_i < len(vals) - 1 and losses[-1] > best + 0.02, f"no fall then rise: {losses}"
    # Every validation's row carries the running best and the count early stopping acts on.
    for i, r in enumerate(vals):
        assert r["best_val_loss"] == min(losses[: i + 1]), r
    assert [r["val_without_improvement"] for r in vals[best_i:]] == list(range(PATIENCE + 1))

    stop = best_step + PATIENCE * TEST_FREQ
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, stop + 1)), "must stop right there"
    assert [r["step"] for r in vals] == list(range(TEST_FREQ, stop + 1, TEST_FREQ)), "validated every test_freq"
    done = [r for r in rows if "early_stopped" in r]
    assert len(done) == 1 and done[0]["step"] == stop and "trainer.early_stopping_patience=3" in done[0]["reason"]
    assert reason == done[0]["reason"] and reason.startswith(f"stopped early at step {stop} of 200: ")

    assert seen[M.VAL_LOSS] == losses[-1] and seen[M.BEST_VAL_LOSS] == best and seen[M.BEST_VAL_STEP] == best_step
    assert seen[M.EARLY_STOPPED] == 1 and seen[M.VALIDATIONS_WITHOUT_IMPROVEMENT] == PATIENCE
    assert seen[M.STEP] == stop

    # The best checkpoint outlived keep_checkpoints=1, and the stop checkpointed (no training on after a restart).
    assert committed_steps(out) == [best_step, stop]
    state = json.loads((out / "checkpoints" / f"step-{stop}" / "trainer_state.json").read_text())
    assert (state["best_val_step"], state["val_without_improvement"]) == (best_step, PATIENCE)

    exported = val_loss_of_export(Path(final), tmp_path / "val.parquet")
    assert abs(exported - best) < 1e-4, f"exported model: {exported}, best validation {best}, last {losses[-1]}"
    assert abs(exported - losses[-1]) > 0.01

    # A restart after the stop (the pod lost during the export, say) exports again without training on.
    with inproc.trainer(args(assets, tmp_path, out, **{**over, "trainer.metrics_port": runner.free_port()})) as again:
        final = again.train()
    assert runner.read_metrics(out) == rows, "the restart trained or validated again"
    assert abs(val_loss_of_export(Path(final), tmp_path / "val.parquet") - best) < 1e-4


def test_a_preempted_run_resumes_the_count_and_stops_at_the_same_step(assets, tmp_path):
    ref_out = tmp_path / "ref"
    ref = runner.run(args(assets, tmp_path, ref_out), ref_out)
    assert ref.code == 0, ref.output
    ref_vals = {r["step"]: r["val_loss"] for r in ref.vals()}
    ref_stop = ref.steps()[-1]["step"]
    best_step = min(ref_vals, key=ref_vals.get)
    assert ref_stop == best_step + PATIENCE * TEST_FREQ < 200

    # SIGTERM one validation after the best: the stop checkpoint holds a count between 0 and patience.
    out = tmp_path / "out"
    cut = runner.run_and_sigterm(args(assets, tmp_path, out), out, after_steps=best_step + TEST_FREQ)
    assert cut.code == 143, cut.output
    at = committed_steps(out)[-1]
    state = json.loads((out / "checkpoints" / f"step-{at}" / "trainer_state.json").read_text())
    assert 1 <= state["val_without_improvement"] < PATIENCE and state["best_val_step"] == best_step, state

    res = runner.run(args(assets, tmp_path, out), out)
    assert res.code == 0, res.why()
    assert res.steps()[-1]["step"] == ref_stop, "the resumed run must stop where the uninterrupted one did"
    vals = {r["step"]: r["val_loss"] for r in res.vals()}
    assert vals.keys() == ref_vals.keys()
    assert all(math.isclose(vals[s], ref_vals[s], rel_tol=1e-5) for s in vals), (vals, ref_vals)
    assert [r["step"] for r in runner.read_metrics(out) if "early_stopped" in r] == [ref_stop]


def at(step: int, s: TrainerState | None = None) -> TrainerState:
    """``s`` (or a fresh state) moved on to ``step``."""
    if s is None:
        s = TrainerState(step=0, epoch=0, cursor=0, total_steps=100, global_batch=8, data_fingerprint="f",
                         world_size=1, tokens_seen=0, lr_scheduler="constant")
    return replace(s, step=step)


def test_a_drop_within_min_delta_becomes_the_best_but_counts_as_no_improvement():
    s = early_stop.after_validation(at(2), 2.0, min_delta=0.1)
    assert (s.best_val_loss, s.best_val_step, s.val_without_improvement) == (2.0, 2, 0)
    s = early_stop.after_validation(at(4, s), 1.95, min_delta=0.1)
    assert (s.best_val_loss, s.best_val_step, s.val_without_improvement) == (1.95, 4, 1)
    s = early_stop.after_validation(at(6, s), float("nan"), min_delta=0.1)
    assert (s.best_val_loss, s.best_val_step, s.val_without_improvement) == (1.95, 4, 2)
    assert math.isnan(s.val_loss) and s.val_step == 6
    s = early_stop.after_validation(at(8, s), 1.8, min_delta=0.1)
    assert (s.best_val_loss, s.best_val_step, s.val_without_improvement) == (1.8, 8, 0)


def test_a_checkpoint_from_before_early_stopping_still_loads():
    """trainer_state.json written before these fields existed: no validation known yet."""
    old = {"step": 5, "epoch": 0, "cursor": 40, "total_steps": 10, "global_batch": 8, "data_fingerprint": "f",
           "world_size": 1, "tokens_seen": 100, "lr_scheduler": "constant", "non_finite_in_a_row": 0}
    s = TrainerState(**old)
    assert (s.val_step, s.best_val_step, s.best_val_loss, s.val_without_improvement) == (-1, -1, None, 0)
