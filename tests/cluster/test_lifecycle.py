"""`up` builds and starts everything, a second `up` is a no-op, `down` leaves nothing behind.

Runs a second, independent cluster (own state directory, ports, subnet and bridge) through the
same CLI that `make cluster-up/down/status` call, so the shared session cluster is untouched.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest

from hack import localcluster
from hack.localcluster import config as C
from hack.localcluster import realnodes

pytestmark = pytest.mark.cluster


def free_ports(n: int) -> list[int]:
    """n ports that are free now, each with port+1 free too (MinIO's console). Picked below the
    kernel's ephemeral range so that an outgoing connection cannot grab one before use."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    out: list[int] = []
    for port in random.sample(range(20000, low - 1, 2), 200):
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError("no free ports")


def test_up_is_idempotent_and_down_leaves_nothing(tmp_path):
    # own ports, picked free, so that nothing else on the machine is mistaken for a component
    api, etcd, peer, minio, kcm, sched, kubelet, dns = free_ports(8)
    env = {**os.environ, "SFTJOB_CLUSTER_DIR": str(tmp_path / "c2"), "SFTJOB_CLUSTER_BRIDGE": "sftjob9",
           "SFTJOB_CLUSTER_SUBNET": "10.245.0.0/16", "SFTJOB_APISERVER_PORT": str(api),
           "SFTJOB_ETCD_PORT": str(etcd), "SFTJOB_ETCD_PEER_PORT": str(peer), "SFTJOB_MINIO_PORT": str(minio),
           "SFTJOB_KCM_PORT": str(kcm), "SFTJOB_SCHEDULER_PORT": str(sched), "SFTJOB_KUBELET_PORT": str(kubelet),
           "SFTJOB_DNS_HEALTH_PORT": str(dns), "SFTJOB_SERVICE_PROXY": "0", "SFTJOB_NODE_IMAGES": "pause",
           "SFTJOB_NODES": "1", "SFTJOB_NODE_PREFIX": "lifecycle-node-"}
    cfg = C.load(env)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hack.localcluster", *args], env=env, cwd=C.REPO,
                              capture_output=True, text=True, timeout=600)

    try:
        # a port held by someone else is refused loudly, before anything starts
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", etcd))
            squatter.listen()
            refused = cli("up")
        assert refused.returncode != 0 and f"127.0.0.1:{etcd} is in use" in refused.stderr, refused.stderr
        assert localcluster.leftover_processes(cfg) == []

        t0 = time.time()
        up = cli("up")
        assert up.returncode == 0, up.stderr
        cold = time.time() - t0
        assert all(localcluster.status(cfg).values()), localcluster.status(cfg)
        pids = {p.name: p.read_text() for p in cfg.pids.glob("*.pid")}
        assert set(pids) == {f"{n}.pid" for n in localcluster.cluster.components(cfg)}
        assert {"containerd-0.pid", "kubelet-0.pid", "coredns.pid"} <= set(pids)
        assert localcluster.cluster.stale_components(cfg) == []

        t0 = time.time()
        again = cli("up")
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        assert time.time() - t0 < 20
        assert {p.name: p.read_text() for p in cfg.pids.glob("*.pid")} == pids  # nothing restarted

        st = cli("status")
        assert st.returncode == 0 and "DOWN" not in st.stdout, st.stdout
        print(f"second cluster: start {cold:.1f}s")
    finally:
        down = cli("down")
    # its nodes' image stores (pause only) live in the binary cache: this cluster is gone for good
    for i in range(len(cfg.nodes)):
        shutil.rmtree(realnodes.store_dir(cfg, i), ignore_errors=True)
    assert down.returncode == 0, down.stderr
    assert localcluster.leftover_processes(cfg) == []
    assert not cfg.state_dir.exists()
    assert subprocess.run(["ip", "link", "show", "sftjob9"], capture_output=True).returncode != 0
    assert cli("status").returncode == 1
