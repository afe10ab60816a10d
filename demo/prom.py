"""Prometheus for the demo: the Debian package, a config the demo rewrites as pods come and
go (file_sd_configs), and small helpers over its HTTP API.

Prometheus listens on loopback only and keeps its data under .demo/prometheus/.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SCRAPE_INTERVAL = "2s"
DEFAULT_PORT = 19090


def binary() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None)


def ensure_installed(say=print) -> str:
    """Install the Debian package when prometheus is missing. Raises when that fails."""
    found = binary()
    if found:
        return found
    say("prometheus not found: apt-get install -y prometheus (Debian package)")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]):
        res = subprocess.run(sudo + argv, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}):\n"
                               f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    found = binary()
    if not found:
        raise RuntimeError("apt-get installed prometheus but no prometheus binary was found")
    return found


def write_config(workdir: Path) -> Path:
    """prometheus.yml: two file_sd jobs whose target files the demo rewrites."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("operator", "trainer"):
        target = workdir / f"targets-{name}.json"
        if not target.exists():
            target.write_text("[]\n")
    cfg = workdir / "prometheus.yml"
    cfg.write_text(f"""# Written by demo/run.py. The target files are rewritten when pods are (re)created.
global:
  scrape_interval: {SCRAPE_INTERVAL}
  scrape_timeout: {SCRAPE_INTERVAL}
  evaluation_interval: {SCRAPE_INTERVAL}
scrape_configs:
  - job_name: sftjob-operator
    file_sd_configs:
      - files: [{workdir / 'targets-operator.json'}]
        refresh_interval: 2s
  - job_name: sftjob-trainer
    file_sd_configs:
      - files: [{workdir / 'targets-trainer.json'}]
        refresh_interval: 2s
""")
    return cfg


def set_targets(workdir: Path, name: str, targets: list[tuple[str, dict[str, str]]]) -> bool:
    """Rewrite targets-<name>.json atomically; True when it changed."""
    path = workdir / f"targets-{name}.json"
    text = json.dumps([{"targets": [addr], "labels": labels} for addr, labels in targets], indent=1) + "\n"
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


class Prometheus:
    """A Prometheus server process on 127.0.0.1:<port> with its TSDB under workdir/data."""

    def __init__(self, workdir: Path, port: int = DEFAULT_PORT):
        self.workdir = workdir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.pidfile = workdir / "prometheus.pid"

    def start(self, exe: str, fresh: bool = True) -> None:
        self.stop()  # a previous demo's server, by its pid file
        cfg = write_config(self.workdir)
        data = self.workdir / "data"
        if fresh and data.exists():
            shutil.rmtree(data)
        log = open(self.workdir / "prometheus.log", "ab")
        proc = subprocess.Popen(
            [exe, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=7d",
             "--web.enable-lifecycle"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        deadline = time.time() + 60
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({proc.returncode}); see {self.workdir / 'prometheus.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready on {self.url} after 60 s")

    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if b"prometheus" in cmdline and str(self.workdir).encode() in cmdline:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                try:  # reap it when it is our child
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(0.1)
        self.pidfile.unlink(missing_ok=True)

    # ---------------------------------------------------------------------------- HTTP API

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 2) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step)["result"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def scraped_ok(self, job: str) -> bool:
        return any(t["labels"].get("job") == job and t.get("health") == "up" for t in self.targets())


# ------------------------------------------------------------------------- dashboard queries

def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) of every target of every panel, rows included."""
    board = json.loads(path.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"{p.get('title', '?')} / {t.get('refId', '?')}", t["expr"]))
            walk(p.get("panels", []))

    walk(board.get("panels", []))
    return out


def grafana_expand(expr: str, variables: dict[str, str] | None = None, rate_interval: str = "1m") -> str:
    """Replace Grafana's template variables the way Grafana would for an 'All' selection."""
    values = {"__rate_interval": rate_interval, "__interval": "10s", "__range": "1h", **(variables or {})}
    for name in sorted(values, key=len, reverse=True):
        expr = re.sub(r"\$\{" + re.escape(name) + r"(:[a-z]+)?\}", values[name], expr)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", values[name], expr)
    return expr


def check_dashboard(prom: Prometheus, path: Path, start: float, end: float,
                    variables: dict[str, str] | None = None) -> list[tuple[str, str, int]]:
    """(title, expanded expr, number of series) for every dashboard query over [start, end]."""
    variables = {"sftjob": ".*", "datasource": "prometheus", **(variables or {})}
    out = []
    for title, expr in dashboard_queries(path):
        q = grafana_expand(expr, variables)
        try:
            n = len(prom.query_range(q, start, end, step=2))
        except Exception:  # noqa: BLE001 - a query Prometheus refuses counts as no data
            n = -1
        out.append((title, q, n))
    return out
