"""The README's generated references must match the CRD and the trainer config."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("extra", [[], ["--trainer"]], ids=["sftjob", "trainer"])
def test_generated_reference_is_current(extra):
    proc = subprocess.run([sys.executable, "-m", "sftjob_operator.reference", *extra, "--check", "README.md"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"README reference is stale; run make crds\n{proc.stdout}{proc.stderr}"


def test_readme_starts_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:20])
    assert "make demo" in head and "make test" in head
