"""The Prometheus metrics rank 0 serves at METRICS_PATH and the operator scrapes.

Gauges without a measurement yet read NaN, never 0; a measured loss or gradient norm that
is not finite is shown as it is (NaN, +Inf), never replaced by the last finite value.
Counters are registered under the names below and exposed with the `_total` suffix Prometheus adds.
"""
from __future__ import annotations

METRICS_PATH = "/metrics"
COUNTER_SUFFIX = "_total"  # what Prometheus appends to a counter's name when it exposes it
# The operator reads rank 0's endpoint this often; after a successful run rank 0 keeps
# serving for LINGER_S, longer than one interval, so the final values reach the status.
SCRAPE_INTERVAL_S = 5.0
LINGER_S = 8.0

STEP = "sftjob_trainer_step"
TOTAL_STEPS = "sftjob_trainer_total_steps"
EPOCH = "sftjob_trainer_epoch"
LOSS = "sftjob_trainer_loss"
VAL_LOSS = "sftjob_trainer_val_loss"
BEST_VAL_LOSS = "sftjob_trainer_best_val_loss"      # the lowest validation loss so far
BEST_VAL_STEP = "sftjob_trainer_best_val_step"      # the step of that validation
# Validations in a row without an improvement (trainer.early_stopping_min_delta) over the best.
VALIDATIONS_WITHOUT_IMPROVEMENT = "sftjob_trainer_validations_without_improvement"
# 1 once early stopping ended training (trainer.early_stopping_patience); 0 otherwise.
EARLY_STOPPED = "sftjob_trainer_early_stopped"
HOLDING = "sftjob_trainer_holding"   # 1 while waiting, checkpointed, for the planned stop the operator asked for
LEARNING_RATE = "sftjob_trainer_learning_rate"
GRAD_NORM = "sftjob_trainer_grad_norm"
TOKENS_PER_SECOND = "sftjob_trainer_tokens_per_second"
MFU = "sftjob_trainer_mfu"
LAST_CHECKPOINT_STEP = "sftjob_trainer_last_checkpoint_step"
CHECKPOINT_SAVE_SECONDS = "sftjob_trainer_checkpoint_save_seconds"
LAST_CHECKPOINT_TIMESTAMP_SECONDS = "sftjob_trainer_last_checkpoint_timestamp_seconds"

# The preflight report, one series per training source (label SOURCE_LABEL: data.sources[i].name, or
# "train" for data.trainFiles); set once the data is scanned, before the first step.
SOURCE_LABEL = "source"
SOURCE_ROWS = "sftjob_trainer_source_rows"                      # rows read
SOURCE_USABLE_ROWS = "sftjob_trainer_source_usable_rows"        # rows that train
SOURCE_DROPPED_ROWS = "sftjob_trainer_source_dropped_rows"      # rows without a trainable token
SOURCE_TRUNCATED_ROWS = "sftjob_trainer_source_truncated_rows"  # rows cut to data.maxLength
SOURCE_TOKENS = "sftjob_trainer_source_tokens"                  # tokens of the usable rows
SOURCE_SAMPLES_PER_EPOCH = "sftjob_trainer_source_samples_per_epoch"  # its weight's share of an epoch

TOKENS = "sftjob_trainer_tokens"                 # counter: sftjob_trainer_tokens_total
SKIPPED_STEPS = "sftjob_trainer_skipped_steps"   # counter: sftjob_trainer_skipped_steps_total
# counter: sftjob_trainer_failed_checkpoint_commits_total (as rank 0 saw them)
FAILED_CHECKPOINT_COMMITS = "sftjob_trainer_failed_checkpoint_commits"
# counter: sftjob_trainer_tracking_errors_total, failed calls to a tracking backend (TensorBoard, MLflow, W&B)
# that training went on without (tracking.py); rows are kept and retried, so a rise means late, not lost.
TRACKING_ERRORS = "sftjob_trainer_tracking_errors"
