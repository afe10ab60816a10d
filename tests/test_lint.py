"""ruff and mypy pass (issue 24): the rule choices live in ruff.toml and mypy.ini, the pinned
tools in requirements-lint.txt (`make lint-install`, which `make test` runs first).

Both tools read the tree to check from their configuration (ruff.toml's `include`, mypy.ini's
`packages`), so this test, `make lint` and a bare `ruff check` / `mypy` at the root agree."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"  # where `make lint-install` puts ruff and mypy

pytestmark = pytest.mark.unit


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `make lint-install` (requirements-lint.txt)")
    # No color, and mypy's cache under .mypy_cache as usual (a warm run takes seconds).
    env = dict(os.environ, NO_COLOR="1", MYPY_FORCE_COLOR="0")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_ruff_finds_nothing():
    res = _run("ruff", "check", "--no-cache", "--output-format", "concise", timeout=300)
    assert res.returncode == 0, f"ruff check failed (see ruff.toml):\n{res.stdout}{res.stderr}"


@pytest.mark.timeout(900)
def test_mypy_finds_nothing():
    res = _run("mypy", timeout=900)
    assert res.returncode == 0, f"mypy failed (see mypy.ini):\n{res.stdout}{res.stderr}"
