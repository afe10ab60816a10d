"""The state the stages share (arguments, the cluster's clients, Prometheus, what the job
did) and the few cluster calls every stage makes."""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from hack.localcluster.kube import ApiError, Kube, ensure_namespace

from demo import prom as promlib
from demo.ui import Out

REPO = Path(__file__).resolve().parents[1]
GROUP_PATH = "/apis/sftjob.io/v1alpha1"


def shown(path: Path) -> Path:
    """A path as printed: relative to the checkout when inside it."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def status(job: dict | None) -> dict:
    """An SFTJob's status ({} before the operator wrote one)."""
    return (job or {}).get("status", {}) or {}


def wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    """pred()'s first truthy value; API errors on the way count as "not yet"."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - transient API errors: poll again
            last = e
        time.sleep(interval)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}" + (f" ({last})" if last else ""))


class Ctx:
    """Filled in stage by stage: the cluster in 1, the assets in 2, the job's times in 3."""

    def __init__(self, args: argparse.Namespace, out: Out):
        self.args = args
        self.out = out
        self.cfg = None                      # hack.localcluster's ClusterConfig
        self.kube: Kube | None = None
        self.env: dict[str, str] = {}        # kubectl/helm/S3 environment of the local cluster
        self.kubectl_bin = ""
        self.helm_bin = ""
        self.prom: promlib.Prometheus | None = None
        self.scraper = None                  # demo.targets.TargetWriter
        self.assets: Path | None = None
        self.preempt_after = 0               # evict once this checkpoint step is committed
        self.t_apply = self.t_end = 0.0
        self.summary: dict[str, Any] = {"namespace": args.namespace, "release": args.release,
                                        "system_namespace": args.system_namespace}

    def run(self, argv: list[str], input: str | None = None, check: bool = True, show: str | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        if show:
            self.out.cmd(show)
        res = subprocess.run(argv, input=input, capture_output=True, text=True, env={**os.environ, **self.env},
                             timeout=timeout)
        if check and res.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run([self.kubectl_bin, *args], **kw)

    def helm(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run([self.helm_bin, *args], **kw)

    def job_path(self) -> str:
        return f"{GROUP_PATH}/namespaces/{self.args.namespace}/sftjobs/{self.args.job}"

    def get_job(self) -> dict | None:
        try:
            return self.kube.get(self.job_path())
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def pods(self, ns: str, selector: str) -> list[dict]:
        return self.kube.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=selector)["items"]

    def ensure_namespace(self, name: str) -> None:
        try:
            ensure_namespace(self.kube, name)
        except TimeoutError as e:
            raise SystemExit(str(e)) from None

    def runs_as(self, ns: str, pod: str) -> dict:
        """Which image a running pod's first container runs (the runtime's imageID) and as
        which uid, asked inside the container (kubectl exec)."""
        p = self.kube.get(f"/api/v1/namespaces/{ns}/pods/{pod}")
        cs = p["status"]["containerStatuses"][0]
        uid = self.kubectl("-n", ns, "exec", pod, "-c", cs["name"], "--", "id", "-u",
                           show=f"kubectl -n {ns} exec {pod} -- id -u").stdout.strip()
        info = {"pod": pod, "image": cs["image"], "imageID": cs["imageID"], "uid": uid}
        self.out.say(f"{pod} runs {cs['image']} ({cs['imageID'][:19]}...) as uid {uid}")
        return info

    def show_events(self, last: int = 6) -> None:
        """The job's latest Events, as `kubectl get events` prints them."""
        a = self.args
        uid = ((self.get_job() or {}).get("metadata") or {}).get("uid", "")
        res = self.kubectl("-n", a.namespace, "get", "events", "--field-selector",
                           f"involvedObject.kind=SFTJob,involvedObject.name={a.job},involvedObject.uid={uid}",
                           "--sort-by=.lastTimestamp",
                           "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message", check=False)
        lines = res.stdout.splitlines()
        if len(lines) > 1:
            self.out.cmd(f"kubectl -n {a.namespace} get events --field-selector involvedObject.name={a.job}")
            for line in [lines[0]] + lines[1:][-last:]:
                self.out.say(line[:160])
