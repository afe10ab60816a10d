"""How a trainer pod ends: its exit code and the one-line termination message.

The operator's failure policy reads both: the exit code says whether a retry can help,
the message `<Reason>: <detail>` says why (docs/trainer-contract.md has the table).
"""
from __future__ import annotations

import signal

SUCCEEDED = 0
FAILED = 1       # any other error: a gang restart can help
PERMANENT = 2    # invalid config or data: the same spec fails again, so no retry
SIGNAL_BASE = 128  # 128 + N: ended by signal N, as a shell reports it
PREEMPTED = SIGNAL_BASE + signal.SIGTERM  # stopped by SIGTERM after a checkpoint (143)

# Reasons, the word before ": " in the termination message.
REASON_INVALID_CONFIG = "InvalidConfig"
REASON_INVALID_DATA = "InvalidData"
REASON_TRAINING_ERROR = "TrainingError"
REASON_PREEMPTED = "Preempted"
REASON_SUCCEEDED = "Succeeded"
# Succeeded, but before the last step: validation loss stopped improving
# (trainer.early_stopping_patience); the message says at which step and why.
REASON_EARLY_STOPPED = "EarlyStopped"
# Object storage refused for a reason a retry cannot fix (access denied, no such bucket):
# the message names the spec field whose URI or credentials are wrong.
REASON_STORAGE_DENIED = "StorageDenied"
# Object storage kept failing for a reason that may pass (connection refused, timeouts,
# 5xx, throttling) after every retry: a gang restart may help.
REASON_STORAGE_UNAVAILABLE = "StorageUnavailable"
# Too many checkpoint commits in a row failed for transient reasons: continuing would
# train on with nothing to resume from.
REASON_CHECKPOINT_FAILED = "CheckpointFailed"
# Too many optimizer steps in a row (or every step) had a non-finite loss or gradient.
REASON_NON_FINITE_LOSS = "NonFiniteLoss"
# A newer attempt of the same job owns the output: this (stale) one stops without writing.
REASON_SUPERSEDED = "Superseded"
# Failures the trainer names; the permanent ones exit PERMANENT.
PERMANENT_REASONS = frozenset({REASON_INVALID_CONFIG, REASON_INVALID_DATA, REASON_STORAGE_DENIED,
                               REASON_NON_FINITE_LOSS})
FAILURE_REASONS = PERMANENT_REASONS | {REASON_TRAINING_ERROR, REASON_STORAGE_UNAVAILABLE,
                                       REASON_CHECKPOINT_FAILED, REASON_SUPERSEDED}

# Kubernetes' default terminationMessagePath; env.TERMINATION_LOG overrides it.
TERMINATION_LOG = "/dev/termination-log"
