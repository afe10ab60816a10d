"""The two guards of an optimizer step: gradient clipping, and skipping a step whose loss or
gradient norm is not finite (issue 27, item 4).

Both look at what the optimizer itself receives, through torch's optimizer step hooks on
the trainer's real optimizer: AdamW's update is nearly blind to the gradient's scale, so
comparing weights would not show whether clipping happened. test_non_finite.py covers
what a run of skipped steps ends in; here, that a skipped step changes nothing.
"""
from __future__ import annotations

import math

import pytest
import torch

from sftjob_contract import metrics as M
from sftjob_trainer.errors import NonFiniteLoss

from . import inproc, runner
from .test_non_finite import poisoned

pytestmark = pytest.mark.unit


def grad_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad.detach().double() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return math.sqrt(sum(float((g * g).sum()) for g in grads))


@pytest.mark.parametrize("clip", [0.05, 0.0], ids=["clipped", "off"])
def test_the_optimizer_receives_gradients_clipped_to_clip_grad(assets, tmp_path, clip):
    out = tmp_path / "out"
    seen: list[float] = []
    with inproc.trainer(runner.base_args(assets, out, **{"optim.clip_grad": clip,
                                                         "trainer.total_training_steps": 3})) as trainer:
        trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(grad_norm(opt)))
        trainer.train()
    before = [r["grad_norm"] for r in runner.read_metrics(out) if "grad_norm" in r]  # reported before clipping
    assert len(seen) == len(before) == 3
    if clip:
        assert all(b > 10 * clip for b in before), f"the test needs gradients well above the clip: {before}"
        assert all(s <= clip * (1 + 1e-4) for s in seen), f"the optimizer received norms {seen} > {clip}"
        assert all(s >= clip * (1 - 1e-3) for s in seen), "clipping scales the gradient to the limit, not below"
    else:  # optim.clip_grad=0 disables clipping: the optimizer receives the gradient as it was
        assert all(math.isclose(s, b, rel_tol=1e-4) for s, b in zip(seen, before)), (seen, before)


def test_a_non_finite_step_is_skipped_leaving_weights_and_optimizer_state_unchanged(assets, tmp_path):
    """Step 1 is clean, step 2 meets a NaN embedding row (NaN loss and gradients), step 3 is
    clean again: the optimizer must step twice, and step 2 must leave everything as it was."""
    model, data = poisoned(assets, tmp_path, "CPC")
    out, port = tmp_path / "out", runner.free_port()
    after: list[dict[str, torch.Tensor]] = []  # the weights after each optimizer step
    entered: list[dict[str, torch.Tensor]] = []  # the weights each optimizer step started from
    snapshot = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731 - a one-line helper
    with inproc.trainer(runner.base_args(assets, out, **{
            "model.path": model, "data.train_files": data, "data.shuffle": False, "trainer.total_training_steps": 3,
            "trainer.max_non_finite_steps": 0, "trainer.metrics_port": port})) as trainer:
        trainer.optimizer.register_step_pre_hook(lambda *_: entered.append(snapshot(trainer.model)))
        trainer.optimizer.register_step_post_hook(lambda *_: after.append(snapshot(trainer.model)))
        with pytest.raises(NonFiniteLoss, match="model.embed_tokens.weight"):
            trainer.train()  # the export refuses the NaN row the data rarely reaches, as it must
        seen = inproc.scrape(port)
        adam_steps = {float(s["step"]) for s in trainer.optimizer.state.values()}

    losses = [r["loss"] for r in runner.read_metrics(out) if "loss" in r]
    assert math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isfinite(losses[2]), losses
    assert len(after) == 2, f"the optimizer stepped {len(after)} times in 3 steps, one of them non-finite"
    assert same(entered[1], after[0]), "the skipped step 2 changed the weights"
    assert adam_steps == {2.0}, f"AdamW's step count moved on the skipped step: {adam_steps}"
    assert seen[M.SKIPPED_STEPS + M.COUNTER_SUFFIX] == 1 and seen[M.STEP] == 3


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit, NaN where NaN (the poisoned row holds NaN from the start)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)
