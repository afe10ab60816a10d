"""`make restart-gap`'s pure parts: the jobs it runs are valid SFTJobs, and rank 0's log
lines split the stop and the model load (hack/chaos/restart_gap.py)."""
# ruff: noqa: E501 - log lines kept whole
from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

# rank 0's log (kubelet timestamps) around a preemption of the large job, cut to the lines that count
LOG = """\
2026-12-04T23:10:38.909Z 23:10:38 [rank0] WARNING sftjob_trainer.train: SIGTERM: will checkpoint at the next step boundary and exit
2026-12-04T23:10:50.419Z 23:10:50 [rank0] INFO sftjob_trainer.train: step 6/60 loss 3.2203 lr 1e-05 grad_norm 27.273 tokens/s 5
2026-12-04T23:10:50.853Z 23:10:50 [rank0] INFO sftjob_trainer.train: checkpoint step-6 written in 0.38s (committing in the background)
2026-12-04T23:11:06.329Z 23:11:06 [rank0] INFO sftjob_trainer.checkpointer: checkpoint s3://b/runs/j/u/checkpoints/step-6 committed (4 files, 15.48s after the save)
2026-12-04T23:11:06.351Z 23:11:06 [rank0] WARNING sftjob_trainer: stopped after SIGTERM: checkpoint step-6 committed
2026-12-04T23:11:14.930Z 23:11:14 [rank0] INFO sftjob_trainer.fence: attempt 1 owns s3://b/runs/j/u
2026-12-04T23:11:17.406Z 23:11:17 [rank0] INFO sftjob_trainer.downloads: downloaded 1460561111 bytes in 6 files from s3://b/models/gap-large to /var/lib/sftjob/models/948e (2.2s)
2026-12-04T23:11:20.147Z 23:11:20 [rank0] INFO sftjob_trainer.model: model s3://b/models/gap-large: 365.13M parameters, 365.13M trainable
"""


def test_the_jobs_are_valid_sftjobs_and_large_is_a_full_fine_tune_with_time_to_stop():
    from hack.chaos.restart_gap import LARGE_PREFIX, gap_manifest
    from sftjob_operator.api import SFTJobSpec

    tiny, large = (SFTJobSpec.model_validate(gap_manifest(m, f"gap-{m}")["spec"]) for m in ("tiny", "large"))
    assert tiny.training.lora.rank > 0 and large.training.lora.rank == 0
    assert large.model.path.endswith(LARGE_PREFIX)
    assert large.run_policy.termination_grace_period_seconds >= 300   # a 4.4 GB stop checkpoint
    assert tiny.training.total_training_steps > tiny.checkpoint.interval * 4


def test_stop_and_model_load_split_by_rank0_log(tmp_path):
    from hack.chaos.gap import rfc3339
    from hack.chaos.restart_gap import details

    log = tmp_path / "trainer.log"
    log.write_text(LOG)
    at = {"begin": rfc3339("2026-12-04T23:10:38.5Z"), "stop": rfc3339("2026-12-04T23:11:08.0Z"),
          "container": rfc3339("2026-12-04T23:11:09.0Z"), "model load": rfc3339("2026-12-04T23:11:20.147Z")}
    got = details(at, log, "s3://b/models/gap-large")
    assert got["until rank 0's SIGTERM"] == 0.4
    assert got["rank 0's stop checkpoint committed"] == 27.4
    assert got["then pods gone"] == 1.6
    assert got["stop checkpoint step"] == 6
    assert got["start-up (imports, fence)"] == 5.9
    assert got["model download"] == 2.2 and got["model MB downloaded"] == 1460.6
    assert details(at, log, "s3://b/models/other")["model download"] == 0.0   # a resume that read no weights
