"""The faults `make chaos` injects, each with the effect it must have on the job's status.

Every fault acts the way the real thing would reach the system, through the same paths:

| kind             | what is done                                                        | expected effect      |
|------------------|---------------------------------------------------------------------|----------------------|
| pod-delete       | a training pod deleted through the API (graceful: SIGTERM, checkpoint) | 1 preemption       |
| trainer-sigkill  | SIGKILL to every process of one training pod (the container's main  | 1 preemption (137)   |
|                  | process first, as a runtime's kill of the container)                |                      |
| node-lost        | `localcluster.node_lost(node)` of a training pod's node: its kubelet| 1 preemption         |
|                  | is killed, the Node goes NotReady; restored after the restart       |                      |
| operator-kill    | one operator pod force-deleted (grace 0: SIGKILL at once); its      | none                 |
|                  | Deployment makes a new one                                          |                      |
| operator-kill-all| every operator pod force-deleted at once (both replicas)            | none                 |
| minio-outage     | MinIO stopped just before a checkpoint is due, restarted seconds    | none (the upload is  |
|                  | later, so the checkpoint upload runs into the outage                | retried)             |
| s3-throttle-commit | a fraction of uploads (PUT, POST) answered `503 SlowDown` by the  | none (retried; the   |
|                  | S3 proxy (s3proxy.py) for a while, from just before a checkpoint    | commit lands)        |
| s3-throttle-download | a fraction of reads (GET, HEAD) answered `503 SlowDown` while a | 1 preemption         |
|                  | training pod is deleted and the new gang downloads its model and    |                      |
|                  | checkpoint, until it reports progress                               |                      |
| operator-down-long | the operator scaled to 0 for longer than the job's progress     | none (the deadline   |
|                  | deadline while the job trains, then back                            | runs from when it    |
|                  |                                                                     | could see progress)  |

Pods run in containers on the local cluster's real nodes (kubelet + containerd): a SIGKILL
goes to every process of the trainer container through its node's containerd.
"""
from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from hack import localcluster
from hack.localcluster import components, proc
from hack.localcluster import realnodes
from hack.localcluster.credentials import ensure_secrets
from hack.localcluster.kube import ApiError, wait_for

from .s3proxy import ThrottlingProxy

PREEMPTION = "preemption"

# kind -> (expected restart cause or None, one-line description of the effect)
KINDS: dict[str, tuple[str | None, str]] = {
    "pod-delete": (PREEMPTION, "gang restart counted as a preemption"),
    "trainer-sigkill": (PREEMPTION, "exit 137: gang restart counted as a preemption"),
    "node-lost": (PREEMPTION, "node NotReady: gang restart counted as a preemption"),
    "operator-kill": (None, "no restart; the job carries on"),
    "operator-kill-all": (None, "no restart; the job carries on"),
    "minio-outage": (None, "no restart; the checkpoint upload is retried"),
    "s3-throttle-commit": (None, "no restart; the commit is retried through 503 SlowDown and lands"),
    "s3-throttle-download": (PREEMPTION, "1 preemption; the new gang loads through 503 SlowDown"),
    "operator-down-long": (None, "no restart: the progress deadline counts only what the operator saw"),
    # Not in the default set: a deterministic reproduction of a race (see OPT_IN).
    "sigkill-unwatched": (PREEMPTION, "exit 137 while no operator runs: 1 preemption"),
}
# Kinds `make chaos` leaves out unless asked for with --kinds. sigkill-unwatched scales the
# operator's Deployment to 0, SIGKILLs a rank, waits until its peer has died of the broken
# collective (exit 1), then scales the operator back: the operator then judges a gang with
# one rank signalled (137) and one failed (1), which on a busy machine also happens by chance
# after plain trainer-sigkill faults.
OPT_IN = {"sigkill-unwatched"}
RESTARTING = {k for k, (cause, _) in KINDS.items() if cause}
# Kinds that go through the S3 proxy (the job's endpoint is the proxy's whenever they may run).
THROTTLING = {"s3-throttle-commit", "s3-throttle-download"}
# operator-down-long keeps the operator away this much longer than the job's progress deadline.
BEYOND_DEADLINE_S = 30.0
# Kinds timed to the step before a checkpoint is due, so that its upload meets the fault.
AT_COMMIT = {"minio-outage", "s3-throttle-commit"}


@dataclass
class Fault:
    index: int
    kind: str
    at_step: int | None = None          # the trainer's step when injected (None: unknown)
    target: str = ""
    detail: str = ""
    t: float = 0.0                      # time.time() of the injection
    observed: str = ""                  # what the job's status did
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def expected_cause(self) -> str | None:
        return KINDS[self.kind][0]

    @property
    def expected(self) -> str:
        return KINDS[self.kind][1]


# ------------------------------------------------------------------------------ processes of a pod

def sigkill_pod(cfg, pod: dict) -> list[str]:
    """SIGKILL every process of the pod's running containers through its node's containerd (the
    runtime reports 128+9 = 137); returns the container IDs."""
    killed = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if "running" in (cs.get("state") or {}) and cs.get("containerID"):
            realnodes.signal_container(cfg, pod["spec"]["nodeName"], cs["containerID"], "SIGKILL")
            killed.append(cs["containerID"].split("://", 1)[-1][:12])
    return killed


# ------------------------------------------------------------------------------ injectors

class Injector:
    """Injects one fault at a time against `job` in `ns`; the operator is the chart's release
    `release` in `system_ns` (its pods are found by label, so 1 or 2 replicas both work)."""

    def __init__(self, cfg, kube, ns: str, job: str, system_ns: str, release: str, rng,
                 minio_outage_s: float = 6.0, log: Callable[[str], None] = print,
                 proxy: ThrottlingProxy | None = None, throttle_fraction: float = 0.5, throttle_s: float = 20.0,
                 operator_down_s: float = 120.0, effect_timeout: float = 240.0):
        self.cfg, self.kube, self.ns, self.job = cfg, kube, ns, job
        self.system_ns, self.release, self.rng = system_ns, release, rng
        self.minio_outage_s = minio_outage_s
        self.proxy, self.throttle_fraction, self.throttle_s = proxy, throttle_fraction, throttle_s
        self.operator_down_s, self.effect_timeout = operator_down_s, effect_timeout
        self.log = log
        self.lost_nodes: list[str] = []

    # -- lookups ------------------------------------------------------------------------
    def job_pods(self, attempt: int | None = None) -> list[dict]:
        pods = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods",
                             labelSelector=f"sftjob.io/job-name={self.job}")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") == "Running"]
        if attempt is not None:
            live = [p for p in live if p["metadata"]["labels"].get("sftjob.io/attempt") == str(attempt)]
        return sorted(live, key=lambda p: p["metadata"]["name"])

    def operator_pods(self) -> list[dict]:
        pods = self.kube.get(f"/api/v1/namespaces/{self.system_ns}/pods",
                             labelSelector=f"app.kubernetes.io/instance={self.release}")["items"]
        return sorted((p for p in pods if not p["metadata"].get("deletionTimestamp")),
                      key=lambda p: p["metadata"]["name"])

    def operators_running(self) -> list[dict]:
        return [p for p in self.operator_pods() if (p.get("status") or {}).get("phase") == "Running"
                and any("running" in (cs.get("state") or {}) for cs in p["status"].get("containerStatuses") or [])]

    def _pick_training_pod(self, attempt: int) -> dict:
        pods = wait_for(lambda: self.job_pods(attempt), 60, "a running training pod")
        return self.rng.choice(pods)

    # -- the faults ---------------------------------------------------------------------
    def inject(self, fault: Fault, attempt: int) -> None:
        getattr(self, "_" + fault.kind.replace("-", "_"))(fault, attempt)

    def _pod_delete(self, f: Fault, attempt: int) -> None:
        pod = self._pick_training_pod(attempt)
        name = pod["metadata"]["name"]
        f.t = time.time()
        self.kube.delete(f"/api/v1/namespaces/{self.ns}/pods/{name}")
        f.target, f.detail = name, "DELETE pods/" + name + " (graceful: SIGTERM, the trainer checkpoints)"

    def _trainer_sigkill(self, f: Fault, attempt: int) -> None:
        pod = self._pick_training_pod(attempt)
        f.t = time.time()
        killed = sigkill_pod(self.cfg, pod)
        f.target = pod["metadata"]["name"]
        f.detail = f"SIGKILL container {', '.join(killed)}"

    def _node_lost(self, f: Fault, attempt: int) -> None:
        pod = self._pick_training_pod(attempt)
        node = pod["spec"]["nodeName"]
        f.t = time.time()
        localcluster.node_lost(node, cfg=self.cfg, kill_containers=False)
        self.lost_nodes.append(node)
        f.target, f.detail = node, f"node_lost({node}) under {pod['metadata']['name']}"

    def restore_nodes(self) -> None:
        while self.lost_nodes:
            node = self.lost_nodes.pop()
            localcluster.node_restore(node, cfg=self.cfg)
            self.log(f"node_restore({node})")

    def _operator_kill(self, f: Fault, attempt: int) -> None:
        pods = wait_for(self.operators_running, 180, "a running operator pod")
        victim = self.rng.choice(pods)
        f.t = time.time()
        self._force_delete(victim)
        f.target = victim["metadata"]["name"]
        f.detail = f"force-delete (grace 0) 1 of {len(pods)} operator pods"
        f.extra.update(operators_before=[p["metadata"]["name"] for p in pods], victims=[f.target])

    def _operator_kill_all(self, f: Fault, attempt: int) -> None:
        pods = wait_for(self.operators_running, 180, "a running operator pod")
        f.t = time.time()
        for p in pods:
            self._force_delete(p)
        f.target = ",".join(p["metadata"]["name"] for p in pods)
        f.detail = f"force-delete (grace 0) all {len(pods)} operator pods"
        f.extra.update(operators_before=[p["metadata"]["name"] for p in pods],
                       victims=[p["metadata"]["name"] for p in pods])

    def _force_delete(self, pod: dict) -> None:
        try:
            self.kube.delete(f"/api/v1/namespaces/{self.system_ns}/pods/{pod['metadata']['name']}",
                             {"gracePeriodSeconds": 0})
        except ApiError as e:
            if e.status != 404:
                raise

    def operators_recovered(self, before: list[str], victims: list[str]) -> bool:
        """As many operator pods running as before the kill, none of them a killed one."""
        running = {p["metadata"]["name"] for p in self.operators_running()}
        return len(running) >= len(before) and not running & set(victims)

    def _operator_scale(self) -> tuple[str, int]:
        """(the operator Deployment's scale subresource, its replicas now)."""
        deps = self.kube.get(f"/apis/apps/v1/namespaces/{self.system_ns}/deployments",
                             labelSelector=f"app.kubernetes.io/instance={self.release}")["items"]
        path = f"/apis/apps/v1/namespaces/{self.system_ns}/deployments/{deps[0]['metadata']['name']}/scale"
        return path, self.kube.get(path)["spec"].get("replicas", 1)

    def _stop_operator(self, path: str) -> None:
        self.kube.merge_patch(path, {"spec": {"replicas": 0}})
        # Failed pods of earlier kills (node loss) stay as objects: wait for no running one.
        wait_for(lambda: not [p for p in self.operator_pods()
                              if (p.get("status") or {}).get("phase") in ("Pending", "Running")],
                 120, "the operator pods to stop")

    def _sigkill_unwatched(self, f: Fault, attempt: int) -> None:
        path, replicas = self._operator_scale()
        pod = self._pick_training_pod(attempt)
        try:
            self._stop_operator(path)
            f.t = time.time()
            killed = sigkill_pod(self.cfg, pod)
            peers = [p for p in self.job_pods(attempt) if p["metadata"]["name"] != pod["metadata"]["name"]]
            time.sleep(2.0)
            wait_for(lambda: all((self.kube.get(f"/api/v1/namespaces/{self.ns}/pods/{p['metadata']['name']}")
                                  .get("status") or {}).get("phase") in ("Failed", "Succeeded") for p in peers),
                     120, "the peers to die of the lost rank")
        finally:
            self.kube.merge_patch(path, {"spec": {"replicas": replicas}})
        f.target = pod["metadata"]["name"]
        f.detail = (f"operator scaled to 0, SIGKILL container {', '.join(killed)}, peers ended, "
                    f"operator scaled back to {replicas}")

    def _operator_down_long(self, f: Fault, attempt: int) -> None:
        path, replicas = self._operator_scale()
        f.extra["operators_before"] = [p["metadata"]["name"] for p in self.operators_running()]
        f.t = time.time()
        try:
            self._stop_operator(path)
            time.sleep(self.operator_down_s)
        finally:
            self.kube.merge_patch(path, {"spec": {"replicas": replicas}})
        f.target = "operator"
        f.detail = f"operator scaled to 0 for {time.time() - f.t:.0f}s (longer than the job's progress deadline)"
        f.extra["victims"] = f.extra["operators_before"]

    def _throttled(self, f: Fault, methods: set[str], during: Callable[[], str]) -> None:
        """Run `during` (returns what it did) with `methods` throttled; count what was refused."""
        if self.proxy is None:
            raise RuntimeError(f"{f.kind} needs the S3 proxy (the job's endpoint must be the proxy's)")
        before = dict(self.proxy.counts)
        with self.proxy.throttled(self.throttle_fraction, methods):
            what = during()
        refused = self.proxy.counts["throttled"] - before["throttled"]
        total = refused + self.proxy.counts["passed"] - before["passed"]
        f.extra["throttled"] = refused
        f.target = "S3 " + "/".join(sorted(methods))
        f.detail = f"{what}; {refused} of {total} requests answered 503 SlowDown"

    def _s3_throttle_commit(self, f: Fault, attempt: int) -> None:
        f.t = time.time()

        def window() -> str:
            time.sleep(self.throttle_s)
            return f"uploads throttled {self.throttle_s:g}s"

        self._throttled(f, {"PUT", "POST"}, window)

    def _s3_throttle_download(self, f: Fault, attempt: int) -> None:
        pod = self._pick_training_pod(attempt)
        name = pod["metadata"]["name"]
        job = f"/apis/sftjob.io/v1alpha1/namespaces/{self.ns}/sftjobs/{self.job}"

        def preempt_and_reload() -> str:
            f.t = time.time()
            self.kube.delete(f"/api/v1/namespaces/{self.ns}/pods/{name}")
            # The new gang has loaded its model and checkpoint once the operator reads its progress.
            wait_for(lambda: ((self.kube.get(job).get("status") or {}).get("progress") or {})
                     .get("readingAttempt", -1) > attempt, self.effect_timeout, "the new gang to train")
            return f"DELETE pods/{name}, reads throttled until the new gang trained ({time.time() - f.t:.0f}s)"

        self._throttled(f, {"GET", "HEAD"}, preempt_and_reload)

    def _minio_outage(self, f: Fault, attempt: int) -> None:
        f.t = time.time()
        minio_stop(self.cfg)
        f.target = "minio"
        time.sleep(self.minio_outage_s)
        t = time.time()
        minio_start(self.cfg)
        f.detail = (f"MinIO down {time.time() - f.t:.1f}s (stopped {self.minio_outage_s:g}s, "
                    f"restart took {time.time() - t:.1f}s)")


# ------------------------------------------------------------------------------ MinIO

def minio_stop(cfg) -> None:
    """Stop the cluster's MinIO the way `cluster-down` stops a component (SIGTERM, then SIGKILL)."""
    proc.stop(cfg, "minio", timeout=10)


def minio_start(cfg, timeout: float = 120) -> None:
    """Start MinIO again exactly as `up` does (same command line, data directory, credentials,
    pid file and log), and wait until it is live. Unlike `up`, no free-port check first: the
    connections the old MinIO closed linger in TIME_WAIT, which a plain bind() test mistakes
    for a taken port, while MinIO itself binds with SO_REUSEADDR."""
    argv, env = components.command(cfg, "minio", ensure_secrets(cfg))
    components.start(cfg, "minio", argv, env, check_ports=False)
    components.wait(cfg, "minio", timeout)


def minio_live(cfg) -> bool:
    try:
        with urllib.request.urlopen(f"{cfg.s3_endpoint}/minio/health/live", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
