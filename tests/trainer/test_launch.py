import time

import pytest

from sftjob_trainer.launch import master_addr, wait_resolvable

pytestmark = pytest.mark.unit


def test_master_addr_from_either_spelling():
    assert master_addr(["--nnodes=2", "--master-addr", "job-0.job"]) == "job-0.job"
    assert master_addr(["--master_addr=job-0.job", "--node-rank=1"]) == "job-0.job"
    assert master_addr(["--standalone", "--nproc-per-node=2"]) is None


def test_wait_resolvable():
    assert wait_resolvable("localhost", timeout_s=1)
    t0 = time.monotonic()
    assert not wait_resolvable("no-such-pod.invalid", timeout_s=0.3, interval_s=0.1)
    assert time.monotonic() - t0 < 5
