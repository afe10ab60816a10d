"""Components as detached host processes: each started in its own session (reparented away
from the caller) with a pid file and a log under the state directory, so a cluster started by
`make cluster-up` outlives that command; found again by pid file and command line, stopped
with SIGTERM then SIGKILL. Also the one way this package runs a short command (sh) and logs."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import config as C


def log(msg: str) -> None:
    print(f"[localcluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def read_pid(cfg: C.ClusterConfig, name: str) -> int | None:
    try:
        return int((cfg.pids / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int | None, marker: str) -> bool:
    """True when pid runs and its command line mentions marker (guards against pid reuse).
    Zombies have an empty command line, so they count as dead."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return marker in cmdline


def running(pid: int | None) -> bool:
    """True while pid exists and is not a zombie, whatever its command line says."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def marker(cfg: C.ClusterConfig, name: str) -> str:
    # Every component's command line names the state directory, so the marker both identifies
    # the component and tells two clusters apart.
    return str(cfg.state_dir)


def spawn(cfg: C.ClusterConfig, name: str, argv: list[str], env: dict | None = None) -> int:
    """Start argv detached, its output appended to the component's log; write its pid file."""
    logf = cfg.logs / f"{name}.log"
    # `sh -c 'cmd & echo $!'` detaches the component from the caller: it keeps running after
    # `make cluster-up` or the test session that started it returns.
    script = 'exec 0</dev/null; "$@" >>"$LOG" 2>&1 & echo $!'
    out = subprocess.run(["setsid", "sh", "-c", script, "sh", *argv], check=True, capture_output=True,
                         text=True, env={**(env or os.environ), "LOG": str(logf)}, cwd=str(C.REPO))
    pid = int(out.stdout.strip())
    (cfg.pids / f"{name}.pid").write_text(str(pid))
    return pid


def stop(cfg: C.ClusterConfig, name: str, timeout: float = 20) -> None:
    pid = read_pid(cfg, name)
    if alive(pid, marker(cfg, name)):
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline and alive(pid, marker(cfg, name)):
            time.sleep(0.2)
        if alive(pid, marker(cfg, name)):
            log(f"{name} ignored SIGTERM for {timeout}s: SIGKILL")
            os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")
    (cfg.pids / f"{name}.pid").unlink(missing_ok=True)


def kill_component(cfg: C.ClusterConfig, name: str) -> None:
    """SIGKILL one component (node loss: a kubelet dies with its machine)."""
    pid = read_pid(cfg, name)
    if alive(pid, marker(cfg, name)):
        os.kill(pid, signal.SIGKILL)
        while running(pid):
            time.sleep(0.1)
        log(f"killed {name} (pid {pid})")


@contextlib.contextmanager
def locked(cfg: C.ClusterConfig):
    """Serialise up/down of one cluster between processes (two test sessions starting at once).
    The lock file lives outside the state directory, which down() removes."""
    digest = hashlib.sha1(str(cfg.state_dir).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"sftjob-cluster-{digest}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
