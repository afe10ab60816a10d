"""How `up` tells a component that is starting from one that died, and how it starts one
(no cluster needed: a sleeping Python process stands in for the component)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from hack.localcluster import components, proc
from hack.localcluster import config as C
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


def test_start_refuses_a_taken_port_unless_told_and_records_its_configuration(tmp_path):
    """The free-port check guards every start except MinIO's restart by the chaos harness
    (its old connections linger in TIME_WAIT); either way the pid and the fingerprint that
    stale_components() compares are written."""
    name = "kube-controller-manager"  # listens on 127.0.0.1:<kcm_port> only
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = C.load({"SFTJOB_CLUSTER_DIR": str(tmp_path / "cluster"), "SFTJOB_KCM_PORT": str(taken.getsockname()[1])})
        for sub in ("logs", "pids"):
            (cfg.state_dir / sub).mkdir(parents=True)
        argv = [sys.executable, "-c", "import time; time.sleep(60)", str(cfg.state_dir)]
        with pytest.raises(RuntimeError, match="is in use"):
            components.start(cfg, name, argv)
        assert proc.read_pid(cfg, name) is None
        components.start(cfg, name, argv, check_ports=False)
    pid = proc.read_pid(cfg, name)
    try:
        assert alive(pid, proc.marker(cfg, name))
        assert (cfg.pids / f"{name}.config").read_text() == components.fingerprint(cfg, name, argv)
    finally:
        proc.stop(cfg, name, timeout=5)
    assert not alive(pid, proc.marker(cfg, name)) and proc.read_pid(cfg, name) is None


def test_prepare_builds_the_images_while_the_binaries_build(monkeypatch, tmp_path):
    """A new machine's first `up` waits for the Go builds (CPU) and the image builds (mostly
    downloads and disk writes): they run side by side, each waiting for the other here, so a
    `prepare` that ran them one after the other would time out instead."""
    import threading

    from hack.localcluster import cluster

    images_started, binaries_done = threading.Event(), threading.Event()
    calls = []

    def fake_binaries(components):
        calls.append(("binaries", tuple(components)))
        assert images_started.wait(10), "the images did not start building before the binaries finished"
        binaries_done.set()

    def fake_images(names):
        calls.append(("images", tuple(names)))
        images_started.set()
        assert binaries_done.wait(10), "the binaries did not build while the images did"
        return {}

    monkeypatch.setattr(cluster, "ensure_binaries", fake_binaries)
    monkeypatch.setattr(cluster.images, "build", fake_images)
    monkeypatch.setattr(cluster, "host_packages", lambda: None)
    cfg = C.load({"SFTJOB_CLUSTER_DIR": str(tmp_path / "state")})
    cluster.prepare(cfg, components=("k8s", "kueue"))
    assert sorted(calls) == [("binaries", ("k8s", "kueue")), ("images", tuple(cfg.node_images))]


def test_up_imports_the_images_into_the_nodes_while_the_binaries_still_build(monkeypatch, tmp_path):
    """The cold `make demo` of issue 29 built the trainer image 2 minutes before the Go builds
    ended, then imported it (3 minutes) only after them. `up` hands `prepare` a hook that the
    images' side runs as soon as they are built: it starts the nodes' containerds and imports,
    here while the binaries are still building (they wait for the import to begin)."""
    import threading

    from hack.localcluster import cluster

    importing, binaries_done = threading.Event(), threading.Event()
    order = []

    def fake_binaries(components):
        assert importing.wait(10), "the import waited for the Go builds"
        order.append("binaries built")
        binaries_done.set()

    def fake_nodes_early(cfg, timeout, say):
        order.append("nodes importing")
        importing.set()

    def fake_up(cfg, timeout, say):
        assert binaries_done.is_set()
        order.append("control plane")
        return cfg

    monkeypatch.setattr(cluster, "ensure_binaries", fake_binaries)
    monkeypatch.setattr(cluster.images, "build", lambda names: {})
    monkeypatch.setattr(cluster, "host_packages", lambda: None)
    monkeypatch.setattr(cluster, "_nodes_early", fake_nodes_early)
    monkeypatch.setattr(cluster, "_up", fake_up)
    cfg = C.load({"SFTJOB_CLUSTER_DIR": str(tmp_path / "state")})
    cluster.up(cfg)
    assert order == ["nodes importing", "binaries built", "control plane"]


def test_every_containerd_starts_before_the_first_kubelet():
    """`up` imports the images into all nodes at once, when the first kubelet is due: every
    node's containerd must be running by then."""
    names = components.components(C.load())
    kubelets = [i for i, n in enumerate(names) if n.startswith("kubelet-")]
    containerds = [i for i, n in enumerate(names) if n.startswith("containerd-")]
    assert len(kubelets) == len(containerds) >= 2
    assert max(containerds) < min(kubelets)
