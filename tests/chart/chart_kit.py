"""Rendering the chart for tests: the cached helm binary, `helm template`, parsed documents."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sftjob-operator"
CRD_SOURCE = REPO / "crds" / "sftjob.io_sftjobs.yaml"
CRD_COPY = CHART / "files" / "sftjob.io_sftjobs.yaml"
DOCKERFILES = {"operator": REPO / "images" / "operator" / "Dockerfile",
               "trainer": REPO / "images" / "trainer" / "Dockerfile"}


def _versions() -> dict[str, str]:
    out = {}
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def helm_path() -> str:
    """The helm that hack/build-binaries.sh builds (same as the cluster fixture's)."""
    cache = Path(os.environ.get("SFTJOB_CACHE", Path.home() / ".cache" / "sftjob"))
    cached = cache / f"helm-{_versions()['HELM_VERSION']}" / "bin" / "helm"
    if cached.is_file():
        return str(cached)
    found = shutil.which("helm")
    if not found:
        raise AssertionError(f"helm not found at {cached} nor on PATH: run `hack/build-binaries.sh helm`")
    return found


def helm(*args: str, check: bool = True, chart: Path = CHART) -> subprocess.CompletedProcess:
    argv = [helm_path(), *[str(chart) if a == "CHART" else a for a in args]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def set_args(values: dict[str, str] | None) -> list[str]:
    out: list[str] = []
    for key, value in (values or {}).items():
        out += ["--set", f"{key}={value}"]
    return out


def render_text(values: dict[str, str] | None = None, release: str = "sftjob", namespace: str = "sftjob-system",
                chart: Path = CHART, extra: list[str] | None = None) -> str:
    return helm("template", release, "CHART", "--namespace", namespace, *set_args(values), *(extra or []),
                chart=chart).stdout


def render(values: dict[str, str] | None = None, **kw: Any) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(values, **kw)) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
