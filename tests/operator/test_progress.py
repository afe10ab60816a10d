"""Progress: the trainer's Prometheus text into status.progress."""
from __future__ import annotations

import pytest

from sftjob_operator import progress

pytestmark = pytest.mark.unit

TEXT = """# HELP sftjob_trainer_step Optimizer steps done.
# TYPE sftjob_trainer_step gauge
sftjob_trainer_step 12.0
# TYPE sftjob_trainer_total_steps gauge
sftjob_trainer_total_steps 40.0
# TYPE sftjob_trainer_epoch gauge
sftjob_trainer_epoch 0.0
# TYPE sftjob_trainer_loss gauge
sftjob_trainer_loss 2.718281828
# TYPE sftjob_trainer_tokens_per_second gauge
sftjob_trainer_tokens_per_second 1234.5678
# TYPE sftjob_trainer_last_checkpoint_step gauge
sftjob_trainer_last_checkpoint_step 10.0
# TYPE sftjob_trainer_tokens_total counter
sftjob_trainer_tokens_total 99999.0
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_parse_metrics_picks_the_contract_gauges():
    got = progress.parse_metrics(TEXT)
    assert got == {"step": 12, "totalSteps": 40, "epoch": 0, "loss": 2.718282,
                   "tokensPerSecond": 1234.5678, "lastCheckpointStep": 10}


def test_merge_rounds_summarises_and_stamps_only_on_change():
    new = progress.merge({}, progress.parse_metrics(TEXT), "T1")
    assert (new["summary"], new["loss"], new["tokensPerSecond"], new["updatedTime"]) == ("12/40", 2.7183, 1234.6, "T1")
    assert progress.merge(new, progress.parse_metrics(TEXT), "T2")["updatedTime"] == "T1"


def test_uninitialised_trainer_does_not_wipe_progress():
    before = {"step": 12, "totalSteps": 40, "loss": 2.5, "summary": "12/40"}
    assert progress.merge(before, {"step": 0, "totalSteps": 0, "loss": 0.0}, "T") == before
