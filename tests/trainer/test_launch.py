import os
import subprocess
import sys
import time

import pytest

from sftjob_trainer.allocator import TCMALLOC, TCMALLOC_REPORT, allocator_env
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


def test_the_allocator_rule_preloads_tcmalloc_unless_ld_preload_is_set():
    found = lambda name: "libtcmalloc_minimal.so.4" if name == TCMALLOC else None  # noqa: E731
    env, line = allocator_env({"PATH": "/bin"}, find=found)
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4" and "tcmalloc" in line
    assert int(env[TCMALLOC_REPORT]) >= 1 << 40      # no "large alloc" lines while a big model loads
    env, _ = allocator_env({TCMALLOC_REPORT: "1000"}, find=found)
    assert env[TCMALLOC_REPORT] == "1000"
    for users in ("", "/opt/lib/libjemalloc.so.2"):  # the user's choice, an empty one included
        env, line = allocator_env({"LD_PRELOAD": users}, find=found)
        assert env == {"LD_PRELOAD": users} and repr(users) in line
    env, line = allocator_env({"PATH": "/bin"}, find=lambda name: None)
    assert env == {"PATH": "/bin"} and line == "memory allocator: the C library's malloc (no tcmalloc here)"


def test_a_process_started_with_the_preload_environment_runs_on_tcmalloc():
    """Not only the variable: the library is found on this machine (hack/host-packages.sh
    installs it, as the images carry it) and a process started with that environment has it
    mapped, before any of its own code runs."""
    env, line = allocator_env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert "LD_PRELOAD" in env, f"{line}: install libtcmalloc-minimal4 (hack/host-packages.sh)"
    maps = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "libtcmalloc_minimal" in maps
    plain = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                           capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}).stdout
    assert "libtcmalloc_minimal" not in plain


def test_a_trainer_started_without_the_launcher_reexecutes_itself_on_tcmalloc(tmp_path):
    """`python -m sftjob_trainer` (one process, no launcher) runs on tcmalloc too: it
    re-executes itself with LD_PRELOAD before loading torch, and says so; an empty LD_PRELOAD
    keeps the C library's malloc. A bad override makes both runs stop right after that line."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RANK")}
    cmd = [sys.executable, "-m", "sftjob_trainer", "data.max_length=many"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "memory allocator: tcmalloc" in run.stderr, run.stderr
    run = subprocess.run(cmd, env={**env, "LD_PRELOAD": ""}, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "memory allocator: the C library's malloc (LD_PRELOAD='')" in run.stderr, run.stderr
