"""`helm upgrade` of the operator while a job trains (issue 28 item 7): the new chart, the
upgrade itself, the job's gang, and the job's status read every second meanwhile (which
also measures the ETA the status promised against the time the job really took)."""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.fixtures.cluster import wait_for

from .chart_kit import CHART

# Long enough that an upgrade (two replicas rolled, each Ready) lands while the job trains:
# 0.4-0.9 s a step here. SFTJOB_UPGRADE_JOB_STEPS makes it longer, to measure the ETA on a
# longer job (the ETA lines are printed; run with -s to see them).
UPGRADE_JOB_STEPS = int(os.environ.get("SFTJOB_UPGRADE_JOB_STEPS", "120"))
UPGRADE_TAG = "upgradetest"


def upgraded_chart(tmp_path: Path) -> Path:
    """The chart with one more optional CRD field and a new version."""
    new_chart = tmp_path / "sftjob-operator"
    shutil.copytree(CHART, new_chart)
    crd_file = new_chart / "files" / "sftjob.io_sftjobs.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    for version in crd["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["resources"]["properties"][
            "upgradeProbe"] = {"type": "string", "description": "A field added by the upgrade test."}
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    meta = yaml.safe_load((new_chart / "Chart.yaml").read_text())
    meta["version"] = f"0.1.1-{UPGRADE_TAG}"
    (new_chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return new_chart


def upgrade_mid_run(cluster, release: str, system_ns: str, new_chart: Path, old_leader: str,
                    leader: Callable[[], dict | None]) -> float:
    """helm upgrade to `new_chart` with a new operator image tag (the same image under a
    second name, as a registry would serve a rebuilt one) and a changed value; returns the
    time the upgraded replica was seen leading."""
    from hack.localcluster import images, realnodes

    operator_ref = images.image_refs()["operator"]
    new_ref = operator_ref.rsplit(":", 1)[0] + f":{UPGRADE_TAG}"
    realnodes.tag_image(cluster.cfg, operator_ref, new_ref)
    cluster.helm("upgrade", release, str(new_chart), "-n", system_ns, "--reuse-values",
                 "--set", f"image.tag={UPGRADE_TAG}", "--set", "operator.logFormat=json",
                 "--wait", "--timeout", "180s")
    new = wait_for(lambda: (p := leader()) and p["metadata"]["labels"]["helm.sh/chart"].endswith(UPGRADE_TAG) and p,
                   120, what="the upgraded operator pod to lead")
    assert new["metadata"]["name"] != old_leader
    assert new["spec"]["containers"][0]["image"] == new_ref, new["spec"]["containers"][0]["image"]
    return time.time()


def gang(cluster, namespace: str, job: str = "tiny-lora") -> dict[str, str]:
    """The job's pods, name -> uid: a restart would replace them."""
    pods = cluster.kube.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=sftjob.io/job-name%3D{job}")
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods["items"]}


class Readings:
    """The job's status, read every second in a thread until stopped."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self._read = read
        self.all: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def last(self) -> dict:
        return self.all[-1]["status"] if self.all else {}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.all.append({"at": time.time(), "status": self._read().get("status") or {}})
            except Exception:  # noqa: BLE001 - a transient API error skips one reading
                pass
            self._stop.wait(1.0)

    def eta_report(self, total: int) -> str:
        """The ETA the status showed at the first reading past 25 %, 50 % and 75 % against the
        time until the status showed the last step (what the ETA estimates: steps left x pace;
        the final validation and export after it are not in it)."""
        done = next((r["at"] for r in self.all if (r["status"].get("progress") or {}).get("step") == total), None)
        lines = []
        for mark in (25, 50, 75):
            r = next((r for r in self.all if (p := r["status"].get("progress") or {}).get("percent", 0) >= mark
                      and p.get("estimatedRemainingSeconds") is not None), None)
            if r is None or done is None:
                lines.append(f"ETA at {mark} %: no reading")
                continue
            p = r["status"]["progress"]
            taken = done - r["at"]
            error = (p["estimatedRemainingSeconds"] - taken) / taken if taken > 0 else float("nan")
            lines.append(f"ETA at {p['percent']} % (step {p['step']}/{total}): {p['estimatedRemainingSeconds']} s "
                         f"predicted, {taken:.0f} s taken ({error:+.0%})")
        return "\n".join(lines)
