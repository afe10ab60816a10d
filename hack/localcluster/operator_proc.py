"""The operator as a host process against the local cluster: for the integration tests and
`make bench-operator` (the chart runs it as a pod; this runs the working tree's code directly)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`sftjob-operator --all-namespaces` in the background; can be killed and restarted."""

    def __init__(self, env: dict[str, str], log_path: Path, namespaces: list[str] | None = None,
                 extra_args: list[str] | None = None, live_timeout: float = 60.0):
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        # One namespace (or a few) keeps this operator off the jobs of tests running beside it.
        self.scope = [a for ns in namespaces for a in ("--namespace", ns)] if namespaces else ["--all-namespaces"]
        self.extra_args = list(extra_args or [])   # e.g. the leader-election flags
        self.live_timeout = live_timeout

    def start(self) -> None:
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts} at {time.strftime('%H:%M:%S')} =====\n")
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sftjob_operator.cli", *self.scope, "--watch-timeout", "120",
             "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port),
             *self.extra_args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        deadline = time.time() + self.live_timeout
        while time.time() < deadline:
            if self.healthy():
                return
            time.sleep(0.3)
        raise RuntimeError(f"operator not live after {self.live_timeout:.0f}s:\n{self.tail()}")

    def healthy(self) -> bool:
        """Whether /healthz answers 200; raises when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a node dies under the operator."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""
