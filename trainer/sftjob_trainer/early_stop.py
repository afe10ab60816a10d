"""Validation bookkeeping: the best validation loss, early stopping, and the weights that
``trainer.export=best`` exports.

Everything here is a pure function of the ``TrainerState``, which the checkpoint carries:
a run resumed after a preemption continues the count of validations without improvement
where it was, so it stops at the same step as a run that was never interrupted.

Two notions, on purpose:

- the *best* validation is the lowest loss seen (strictly lower replaces it): the weights
  ``export=best`` exports;
- an *improvement*, which resets the early-stopping count, is a loss lower than the best by
  more than ``trainer.early_stopping_min_delta``; a smaller drop still becomes the best, but
  counts as a validation without improvement.

A NaN validation loss is neither. For ``export=best`` the trainer checkpoints at every
validation that sets a new best (only those weights can be exported), and the checkpointer
keeps that checkpoint from pruning (``Checkpointer.keep_best``) until a better one commits.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace

from sftjob_contract.config import TrainerConfig

from .checkpoint import TrainerState

log = logging.getLogger(__name__)


def after_validation(state: TrainerState, loss: float, min_delta: float) -> TrainerState:
    """``state`` with the validation at ``state.step`` (loss ``loss``) taken into account."""
    best = state.best_val_loss
    finite = math.isfinite(loss)
    is_best = finite and (best is None or loss < best)
    improved = finite and (best is None or loss < best - min_delta)
    return replace(state, val_step=state.step, val_loss=loss,
                   best_val_step=state.step if is_best else state.best_val_step,
                   best_val_loss=loss if is_best else best,
                   val_without_improvement=0 if improved else state.val_without_improvement + 1)


def is_new_best(state: TrainerState) -> bool:
    """Did the validation at this step set the best loss (so export=best needs its weights)?"""
    return state.val_step == state.step and state.best_val_step == state.step


def should_stop(cfg: TrainerConfig, state: TrainerState) -> bool:
    """Has early stopping run out of patience (never, when it is off)?"""
    return 0 < cfg.early_stopping_patience <= state.val_without_improvement


def stopped_early(cfg: TrainerConfig, state: TrainerState, total_steps: int) -> str | None:
    """Why the run stopped before ``total_steps``, for the log and the termination message;
    None when it did not stop early. True again after a resume from the stop's checkpoint."""
    if not should_stop(cfg, state) or state.step >= total_steps:
        return None
    return (f"stopped early at step {state.step} of {total_steps}: {state.val_without_improvement} validations in a "
            f"row without a validation loss lower than the best ({state.best_val_loss:.4f}, step "
            f"{state.best_val_step}) by more than trainer.early_stopping_min_delta="
            f"{cfg.early_stopping_min_delta:g} (trainer.early_stopping_patience={cfg.early_stopping_patience})")


def gauges(state: TrainerState) -> dict[str, float]:
    """The validation gauges the state knows (after a resume, before the next validation)."""
    out: dict[str, float] = {"val_without_improvement": state.val_without_improvement}
    if state.val_loss is not None:
        out["val_loss"] = state.val_loss
    if state.best_val_loss is not None:
        out |= {"best_val_loss": state.best_val_loss, "best_val_step": state.best_val_step}
    return out


def row(state: TrainerState) -> dict[str, float]:
    """The metrics.jsonl line of the validation just taken."""
    assert state.val_loss is not None  # after_validation() set it
    out = {"step": state.step, "val_loss": state.val_loss, "val_without_improvement": state.val_without_improvement}
    if state.best_val_loss is not None:
        out |= {"best_val_loss": state.best_val_loss, "best_val_step": state.best_val_step}
    return out


def restore_best(cfg: TrainerConfig, state: TrainerState, checkpoints, model, optimizer) -> int:
    """Collective. ``export=best``: load the weights of the best validation's checkpoint into
    ``model``; returns the step whose weights the model now holds (``state.step`` when they
    already are the best, or when there is nothing better to load)."""
    best = state.best_val_step
    if cfg.export != "best" or best == state.step:
        return state.step
    if best < 0:
        log.warning("trainer.export=best: no validation had a finite loss; exporting the last step's weights "
                    "(step %d)", state.step)
        return state.step
    if not checkpoints.committed(best):
        # A failed commit at exactly that step: exporting the last weights beats exporting none.
        log.warning("trainer.export=best: the checkpoint of the best validation (step-%d, val_loss %.4f) was not "
                    "committed; exporting the last step's weights (step %d) instead", best, state.best_val_loss,
                    state.step)
        return state.step
    checkpoints.load(best, model, optimizer)
    log.info("trainer.export=best: exporting the weights of step %d (val_loss %.4f), not those of the last step %d",
             best, state.best_val_loss, state.step)
    return best
