"""How `up` tells a component that is starting from one that died (no cluster needed)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hack.localcluster.proc import alive, running

pytestmark = pytest.mark.unit


def test_running_ignores_the_command_line_but_not_death():
    me = os.getpid()
    assert running(me)
    assert not alive(me, "/no/such/state-dir")  # the marker check alone would call it dead
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while running(child.pid) and time.time() < deadline:  # exits, stays a zombie until reaped
        time.sleep(0.05)
    assert not running(child.pid)
    child.wait()
    assert not running(child.pid) and not running(None)
