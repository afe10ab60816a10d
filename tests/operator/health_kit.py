"""The GitOps health harness (hack/tools/health) for tests: built on first use into the
version-keyed cache by hack/build-binaries.sh, run on object files or on a live object."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHECK_DIR = REPO / "integrations" / "argocd" / "resource_customizations" / "sftjob.io" / "SFTJob"
HEALTH_LUA = CHECK_DIR / "health.lua"
TESTDATA = CHECK_DIR / "testdata"
FLUX_EXPRS = REPO / "integrations" / "flux" / "healthcheckexprs.yaml"
BUILD = REPO / "hack" / "build-binaries.sh"


def harness() -> str:
    """Path of the built harness; builds it (a few minutes, once per source change) if absent."""
    dirs = subprocess.run([str(BUILD), "--print-dirs"], capture_output=True, text=True, check=True).stdout
    binary = Path(dict(line.split("=", 1) for line in dirs.split())["health"]) / "bin" / "health"
    if not binary.is_file():
        run = subprocess.run([str(BUILD), "health"], capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "SFTJOB_GO_P": os.environ.get("SFTJOB_GO_P", "2")})
        assert run.returncode == 0, f"hack/build-binaries.sh health failed:\n{run.stderr[-3000:]}"
    return str(binary)


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([harness(), *args], input=stdin, capture_output=True, text=True, timeout=60)


def evaluate(obj: dict[str, Any] | Path, lua: Path = HEALTH_LUA, exprs: Path = FLUX_EXPRS) -> dict[str, Any]:
    """{"argo": {status, message}, "kstatus": {...}, "flux": {...}} for one object (a file or
    a live object as the API server returned it)."""
    if isinstance(obj, Path):
        proc = run("all", str(lua), str(exprs), str(obj))
    else:
        proc = run("all", str(lua), str(exprs), "-", stdin=json.dumps(obj))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def summary(result: dict[str, Any]) -> tuple[str, str, str]:
    """(Argo CD health, kstatus, Flux) statuses."""
    return result["argo"]["status"], result["kstatus"]["status"], result["flux"]["status"]
