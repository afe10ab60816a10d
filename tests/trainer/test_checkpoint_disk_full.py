"""A checkpoint that cannot be written (here: its file system fills up) ends the run with a
one-line reason naming the directory and the full disk, like every other failure.
torch.distributed.checkpoint reports a failed write as CheckpointException, a BaseException:
unconverted it passed every `except Exception`, so the ranks died with a raw traceback and
the pod had no termination message for the operator to show."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from sftjob_contract import env as E
from sftjob_contract import exits
from tests.trainer import runner

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk():
    """A 6 MiB tmpfs: room for a few checkpoints of the tiny model, not for forty."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    d = Path(tempfile.mkdtemp(prefix="sftjob-small-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def test_a_full_disk_fails_the_run_with_a_reason_naming_it(assets, small_disk, tmp_path):
    out = small_disk / "out"
    termination = tmp_path / "termination-log"
    args = runner.base_args(assets, out, **{"trainer.total_training_steps": 40, "data.micro_batch_size_per_gpu": 2,
                                            "trainer.save_freq": 1, "trainer.keep_checkpoints": 50})
    started = time.monotonic()
    res = runner.run(args, out, nproc=2, timeout=300, extra_env={E.TERMINATION_LOG: str(termination)})
    assert res.code == exits.FAILED, res.why()
    assert time.monotonic() - started < 120, "a failed write must end the run, not leave it waiting"
    reason = termination.read_text().strip()
    assert reason.startswith(f"{exits.REASON_TRAINING_ERROR}: "), reason
    assert f"writing checkpoint {out}/checkpoints/step-" in reason, reason
    assert f"the file system holding {out}/checkpoints/step-" in reason and "is full" in reason, reason
    # what was committed before the disk filled is still whole: the newest is resumable
    committed = sorted(out.glob("checkpoints/step-*/COMMITTED"))
    assert committed, res.why()
