"""Errors that end a run with a reason the operator can show to the user.

The exit code tells the operator whether retrying can help (sftjob_contract.exits,
docs/trainer-contract.md): configuration and data problems are permanent, anything else
is a plain failure.
"""
from __future__ import annotations

from sftjob_contract import exits


class TrainerError(Exception):
    """An error with a one-line reason; ``reason`` is a CamelCase constant."""

    reason = exits.REASON_TRAINING_ERROR
    exit_code = exits.FAILED


class InvalidConfig(TrainerError):
    reason = exits.REASON_INVALID_CONFIG
    exit_code = exits.PERMANENT


class InvalidData(TrainerError):
    reason = exits.REASON_INVALID_DATA
    exit_code = exits.PERMANENT


class StorageDenied(TrainerError):
    """Object storage refused in a way a retry cannot fix; the message names the field."""
    reason = exits.REASON_STORAGE_DENIED
    exit_code = exits.PERMANENT


class StorageUnavailable(TrainerError):
    """Object storage still failing, for a transient reason, after every retry."""
    reason = exits.REASON_STORAGE_UNAVAILABLE
    exit_code = exits.FAILED


class CheckpointFailed(TrainerError):
    """Too many checkpoint commits in a row failed (transient causes)."""
    reason = exits.REASON_CHECKPOINT_FAILED
    exit_code = exits.FAILED


class NonFiniteLoss(TrainerError):
    """Training produced only non-finite losses or gradients for too long."""
    reason = exits.REASON_NON_FINITE_LOSS
    exit_code = exits.PERMANENT


class Superseded(TrainerError):
    """A newer attempt owns the output prefix (fence.py): this one must not write there."""
    reason = exits.REASON_SUPERSEDED
    exit_code = exits.FAILED
