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
