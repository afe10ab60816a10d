"""NetworkPolicy enforcement for the local cluster: SIG Network's reference implementation
(sigs.k8s.io/kube-network-policies) run by hack/tools/netpol as one host process for all
nodes (they share the host's network namespace and bridge; see its main.go for what differs
from upstream's DaemonSet and why).

The bridge CNI enforces nothing, so without this a NetworkPolicy is only an object. It is not
part of `up`: every new connection of a pod then waits for a userspace verdict, and a policy
that selects a pod drops what it does not allow, which the tests that are not about policies
should not depend on. Start it around what should be policed:

    with enforcing(cfg):
        ...   # the cluster's NetworkPolicies hold

The binary is built by `hack/build-binaries.sh netpol` into the cache (`make test` builds it
with the cluster's binaries); one enforcer per cluster (its iptables chain and nfqueue are
named after the cluster's bridge)."""
from __future__ import annotations

import contextlib
import hashlib
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from . import config as C

READY_TIMEOUT_S = 120


def binary() -> Path:
    """The enforcer, built on first use (a no-op when the cache has it)."""
    subprocess.run([str(C.HACK / "build-binaries.sh"), "netpol"], check=True)
    return C.bin_dir("netpol") / "netpol"


def names(cfg: C.ClusterConfig) -> tuple[str, int]:
    """(iptables chain, nfqueue number) of this cluster's enforcer: two clusters on one host
    (different bridges) must not share them. A chain name has at most 28 characters."""
    digest = int(hashlib.sha256(cfg.bridge.encode()).hexdigest(), 16)
    return f"SFTJOB-NP-{digest % 16**8:08x}", 100 + digest % 30000


@contextlib.contextmanager
def enforcing(cfg: C.ClusterConfig | None = None, log_path: Path | None = None) -> Iterator[Path]:
    """Run the enforcer for the duration of the block; yields its log's path. Returns only once
    packets are being decided (the enforcer prints `ready` after its rules are in place), and
    removes its rules on the way out (SIGTERM; it deletes its chain)."""
    cfg = cfg or C.load()
    chain, queue = names(cfg)
    log_path = log_path or cfg.state_dir / "logs" / "netpol.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(binary()), "--kubeconfig", str(cfg.kubeconfig), "--pod-cidr", str(cfg.subnet),
            "--queue", str(queue), "--chain", chain]
    with log_path.open("a") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        first: list[str] = []
        answered = threading.Event()   # its first line, or "" when it exited without one

        def read() -> None:
            first.append(proc.stdout.readline().strip())
            answered.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            if not answered.wait(READY_TIMEOUT_S) or first[0] != "ready":
                raise RuntimeError(f"the NetworkPolicy enforcer was not ready (exit {proc.poll()}); "
                                   f"its log: {log_path}")
            yield log_path
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
