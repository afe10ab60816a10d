"""How `up` tells a component that is starting from one that died (no cluster needed)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hack.localcluster.cluster import _alive, _running

pytestmark = pytest.mark.unit


def test_running_ignores_the_command_line_but_not_death():
    me = os.getpid()
    assert _running(me)
    assert not _alive(me, "/no/such/state-dir")  # the marker check alone would call it dead
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while _running(child.pid) and time.time() < deadline:  # exits, stays a zombie until reaped
        time.sleep(0.05)
    assert not _running(child.pid)
    child.wait()
    assert not _running(child.pid) and not _running(None)
