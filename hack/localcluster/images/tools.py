"""Running the tools the images are built and loaded with: each one found on PATH (or named by
its Debian package), its output logged; plus the log line and size format every step uses."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from collections.abc import Mapping, Sequence

from .spec import ImagesError

# The Debian package that provides each tool this package runs.
PACKAGES = {"buildah": "buildah", "mmdebstrap": "mmdebstrap", "gcc": "gcc libc6-dev", "ctr": "containerd"}


def log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def need(tool: str) -> str:
    """The tool's path, or an error naming the Debian package that provides it."""
    path = shutil.which(tool)
    if not path:
        raise ImagesError(f"{tool} not found on PATH: install it with `apt-get install {PACKAGES[tool]}`")
    return path


def run(cmd: Sequence[str], *, logfile: Path | None = None, verbose: bool = False,
        env: Mapping[str, str] | None = None) -> str:
    """Run cmd; return its stdout. Its stderr (and, with a logfile, its stdout too) goes to
    the logfile; verbose also echoes it. A failure raises with the output's tail."""
    if logfile is None:
        res = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise ImagesError(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stderr.strip()[-4000:]}")
        return res.stdout
    with logfile.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, bufsize=1)
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            if verbose:
                sys.stderr.write(line)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(lines[-40:])
        raise ImagesError(f"{' '.join(cmd[:3])} ... failed (exit {rc}); full log: {logfile}\n{tail}")
    return "".join(lines)
