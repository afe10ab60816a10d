"""The operator benchmark's instruments: the operator process (RSS, CPU, /metrics), a pod
watch that timestamps every pod's first sighting, the black hole that makes kwok's fake pod
IPs unreachable, and the head-of-line probe (delete a pod, time the replacement gang)."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from hack.localcluster.kube import ApiError, Kube
from hack.localcluster.operator_proc import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
JOBS = "/apis/sftjob.io/v1alpha1/namespaces/{ns}/sftjobs"
EXAMPLE = REPO / "examples" / "sftjob.yaml"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


class Operator(OperatorProcess):
    """The operator process of the shared harness, plus RSS sampling and parsed metrics."""

    def __init__(self, env: dict[str, str], ns: str, log_path: Path):
        super().__init__(env, log_path, namespaces=[ns], live_timeout=90)
        self.rss_samples: list[tuple[float, int]] = []
        self._stop = threading.Event()

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.rss_samples.append((time.time(), self.status_kb("VmRSS")))

    def status_kb(self, key: str) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def cpu_seconds(self) -> float:
        try:
            f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return 0.0

    def samples(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{labels}': value}."""
        out = {}
        for line in self.metrics().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        self._stop.set()
        super().stop()


class PodWatch(threading.Thread):
    def __init__(self, kube: Kube, ns: str):
        super().__init__(daemon=True, name="pod-watch")
        self.kube, self.ns = kube, ns
        self.seen: dict[str, float] = {}           # pod uid -> first seen (time.time())
        self.by_job: dict[str, list[tuple[float, str, str]]] = {}   # job -> [(seen, pod name, attempt)]
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.rv = kube.get(f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
        self.errors = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                for ev in self.kube.watch(f"/api/v1/namespaces/{self.ns}/pods", self.rv, timeout_s=120):
                    now = time.time()
                    obj = ev.get("object") or {}
                    md = obj.get("metadata") or {}
                    if md.get("resourceVersion"):
                        self.rv = md["resourceVersion"]
                    if ev.get("type") == "ERROR":
                        raise ApiError(410, json.dumps(obj), "WATCH", "pods")
                    if ev.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    uid = md["uid"]
                    labels = md.get("labels") or {}
                    with self.lock:
                        if uid not in self.seen:
                            self.seen[uid] = now
                            self.by_job.setdefault(labels.get("sftjob.io/job-name", ""), []).append(
                                (now, md["name"], labels.get("sftjob.io/attempt", "")))
                        if (obj.get("status") or {}).get("phase") == "Running":
                            self.running.add(uid)
                    if self.stopped.is_set():
                        return
            except ApiError as e:
                self.errors += 1
                if e.status == 410:  # too old: relist
                    self.rv = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods")["metadata"]["resourceVersion"]
            except OSError:
                self.errors += 1
                time.sleep(0.5)

    def count(self) -> int:
        with self.lock:
            return len(self.seen)


def job_manifest(name: str) -> dict[str, Any]:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name}
    spec = obj["spec"]
    # Small requests, so that 2 pods x 1,000 jobs fit on 22 fake nodes of 32 CPUs / 256 GiB
    # (the example's 1 CPU / 4 GiB would leave two thirds of the pods Pending: unschedulable).
    spec["resources"]["cpu"] = "100m"
    spec["resources"]["memory"] = "256Mi"
    spec["resources"]["nodeSelector"] = {"type": "kwok"}
    spec["resources"]["tolerations"] = [KWOK_TAINT]
    spec["runPolicy"]["restartBackoffSeconds"] = 0
    spec["runPolicy"].pop("ttlSecondsAfterFinished", None)
    return obj


KWOK_POD_CIDR = "10.250.0.0/16"  # kwok's --cidr in hack/localcluster/kwok.py
HOLE_NETNS, HOLE_DEV, HOLE_NET = "benchop-hole", "benchop0", ("10.251.255.1", "10.251.255.2")


class BlackHole:
    """Make kwok's fake pod IPs truly unreachable: a SYN to them is never answered.

    Without this, this host's default route may reach something that answers for any
    address (a proxy answered HTTP 404 in 2 ms on the CI VM), and the scrape load would be
    nothing like a dead pod's. The route sends KWOK_POD_CIDR through a veth to a network
    namespace that does not forward, where the packets are dropped without a reply, as for a
    pod IP that vanished on a real cluster. Removed again on exit (deleting the veth removes
    the route)."""

    def __init__(self) -> None:
        self.up = False

    @staticmethod
    def _ip(*a: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *a], capture_output=True, text=True, check=check)

    def __enter__(self) -> BlackHole:
        self.__exit__()  # leftovers of an interrupted run
        host, peer = HOLE_NET
        self._ip("netns", "add", HOLE_NETNS)
        self._ip("link", "add", HOLE_DEV, "type", "veth", "peer", "name", "eth0", "netns", HOLE_NETNS)
        self._ip("addr", "add", f"{host}/30", "dev", HOLE_DEV)
        self._ip("link", "set", HOLE_DEV, "up")
        self._ip("-n", HOLE_NETNS, "addr", "add", f"{peer}/30", "dev", "eth0")
        self._ip("-n", HOLE_NETNS, "link", "set", "eth0", "up")
        self._ip("route", "replace", KWOK_POD_CIDR, "via", peer)
        self.up = True
        return self

    def __exit__(self, *exc) -> None:
        self._ip("link", "del", HOLE_DEV, check=False)
        self._ip("netns", "del", HOLE_NETNS, check=False)
        self.up = False


METRICS_PORT = 9400  # the trainer's metrics port the operator scrapes (builders.METRICS_PORT)


def syn_sent(port: int) -> int:
    """TCP connections to `port` still waiting for an answer (SYN sent): scrapes of endpoints
    that do not answer (kwok's fake pod IPs), in flight right now."""
    out = subprocess.run(["ss", "-Htn", "state", "syn-sent", f"( dport = :{port} )"], capture_output=True, text=True)
    return len([line for line in out.stdout.splitlines() if line.strip()])


def wait_running(kube: Kube, ns: str, name: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ((kube.get(f"{JOBS.format(ns=ns)}/{name}").get("status") or {}).get("phase")) == "Running":
            return
        time.sleep(0.3)
    raise SystemExit(f"{name} not Running after {timeout:.0f}s")


def probe(kube: Kube, ns: str, watch: PodWatch, name: str, errors: list[str], timeout: float = 120) -> float:
    """Delete rank 1 of a Running job (grace 0, a lost pod); seconds until both pods of the
    replacement gang exist."""
    wait_running(kube, ns, name, timeout)
    with watch.lock:
        before = {a for _, _, a in watch.by_job.get(name, [])}
    t0 = time.time()
    try:
        kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}-node-1", {"gracePeriodSeconds": 0})
    except ApiError as e:
        errors.append(f"probe delete {name}: {e}")
        return float("inf")
    end = t0 + timeout
    while time.time() < end:
        with watch.lock:
            new = [s for s, _, a in watch.by_job.get(name, []) if a not in before]
        if len(new) >= 2:
            return max(new) - t0
        time.sleep(0.05)
    return float("inf")
