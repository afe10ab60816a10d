"""Keep the logs of pods that come and go: a kubelet forgets a pod's log when the pod is deleted,
and a restarted gang re-creates its pods under the same names. LogTap follows every container of
every matching pod while it runs (`kubectl logs -f`, through the API server) and appends the
lines to DIR/<namespace>_<pod>/<container>.log, one file across all incarnations of the name.

    tap = LogTap(kube, "team-a", "sftjob.io/job-name=demo", Path(".demo/logs")).start()
    ...
    tap.path("demo-node-0", "trainer").read_text()
    tap.stop()
"""
from __future__ import annotations

import threading
from pathlib import Path

from .kube import ApiError, Kube


class LogTap:
    def __init__(self, kube: Kube, namespace: str, label_selector: str, directory: Path, poll_s: float = 1.0,
                 timestamps: bool = False):
        self.kube, self.ns, self.selector = kube, namespace, label_selector
        self.dir, self.poll_s = Path(directory), poll_s
        self.timestamps = timestamps   # each line starts with the kubelet's RFC 3339 time (kubectl logs --timestamps)
        self._stop = threading.Event()
        self._followed: set[tuple[str, str]] = set()   # (pod uid, container)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"logtap-{namespace}")

    def path(self, pod: str, container: str) -> Path:
        return self.dir / f"{self.ns}_{pod}" / f"{container}.log"

    def start(self) -> LogTap:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.kube.get(f"/api/v1/namespaces/{self.ns}/pods", labelSelector=self.selector)["items"]
            except (ApiError, OSError):
                pods = []
            for p in pods:
                uid, name = p["metadata"]["uid"], p["metadata"]["name"]
                for cs in (p.get("status") or {}).get("containerStatuses") or []:
                    started = "running" in cs["state"] or "terminated" in cs["state"]
                    key = (uid, cs["name"])
                    with self._lock:
                        if not started or key in self._followed:
                            continue
                        self._followed.add(key)
                    threading.Thread(target=self._follow, args=(name, cs["name"]), daemon=True).start()
            self._stop.wait(self.poll_s)

    def _follow(self, pod: str, container: str) -> None:
        """Stream one container's log until it ends (the container stopped or the pod went)."""
        out = self.path(pod, container)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            with out.open("ab") as f:
                for line in self.kube.lines(f"/api/v1/namespaces/{self.ns}/pods/{pod}/log", 3600,
                                            container=container, follow="true",
                                            **({"timestamps": "true"} if self.timestamps else {})):
                    f.write(line)
                    f.flush()
                    if self._stop.is_set():
                        return
        except (ApiError, OSError):
            pass
