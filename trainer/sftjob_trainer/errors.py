"""Errors that end a run with a reason the operator can show to the user.

The exit code tells the operator whether retrying can help (see docs/trainer-contract.md):
configuration and data problems are permanent (exit 2), anything else is exit 1.
"""
from __future__ import annotations


class TrainerError(Exception):
    """An error with a one-line reason; ``reason`` is a CamelCase constant."""

    reason = "TrainingError"
    exit_code = 1


class InvalidConfig(TrainerError):
    reason = "InvalidConfig"
    exit_code = 2


class InvalidData(TrainerError):
    reason = "InvalidData"
    exit_code = 2


# Exit code for "stopped by SIGTERM after a checkpoint": 128 + SIGTERM, as a shell reports it.
EXIT_PREEMPTED = 143
