"""`up` builds and starts everything, a second `up` is a no-op, `down` leaves nothing behind.

Runs a second, independent cluster (own state directory, ports, subnet and bridge) through the
same CLI that `make cluster-up/down/status` call, so the shared session cluster is untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hack import localcluster
from hack.localcluster import config as C

pytestmark = pytest.mark.cluster


def test_up_is_idempotent_and_down_leaves_nothing(tmp_path):
    env = {**os.environ, "SFTJOB_CLUSTER_DIR": str(tmp_path / "c2"), "SFTJOB_CLUSTER_BRIDGE": "sftjob9",
           "SFTJOB_CLUSTER_SUBNET": "10.245.0.0/16", "SFTJOB_APISERVER_PORT": "16443",
           "SFTJOB_ETCD_PORT": "12379", "SFTJOB_ETCD_PEER_PORT": "12380", "SFTJOB_MINIO_PORT": "19000",
           "SFTJOB_KCM_PORT": "20257", "SFTJOB_SCHEDULER_PORT": "20259", "SFTJOB_NETNS_PREFIX": "sftk",
           "SFTJOB_NODES": "1", "SFTJOB_NODE_PREFIX": "lifecycle-node-"}
    cfg = C.load(env)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hack.localcluster", *args], env=env, cwd=C.REPO,
                              capture_output=True, text=True, timeout=600)

    try:
        t0 = time.time()
        up = cli("up")
        assert up.returncode == 0, up.stderr
        cold = time.time() - t0
        assert all(localcluster.status(cfg).values())
        pids = {p.name: p.read_text() for p in cfg.pids.iterdir()}
        assert set(pids) == {f"{n}.pid" for n in localcluster.cluster.COMPONENTS}

        t0 = time.time()
        again = cli("up")
        assert again.returncode == 0 and "already up" in again.stderr
        assert time.time() - t0 < 20
        assert {p.name: p.read_text() for p in cfg.pids.iterdir()} == pids  # nothing restarted

        st = cli("status")
        assert st.returncode == 0 and "DOWN" not in st.stdout
        print(f"second cluster: start {cold:.1f}s")
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert localcluster.leftover_processes(cfg) == []
    assert not cfg.state_dir.exists()
    assert subprocess.run(["ip", "link", "show", "sftjob9"], capture_output=True).returncode != 0
    assert cli("status").returncode == 1
