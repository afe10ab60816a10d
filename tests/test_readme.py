"""The generated references (docs/reference/) must match the CRD and the trainer config, and the
README stays short and starts with the two commands."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("extra, page",
                         [([], "docs/reference/sftjob.md"), (["--trainer"], "docs/reference/trainer-config.md")],
                         ids=["sftjob", "trainer"])
def test_generated_reference_is_current(extra, page):
    proc = subprocess.run([sys.executable, "-m", "tools.reference", *extra, "--check", page], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{page} is stale; run make crds\n{proc.stdout}{proc.stderr}"


def test_readme_starts_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:20])
    assert "make demo" in head and "make test" in head


def test_readme_reads_in_five_minutes_and_every_doc_is_reachable():
    """A newcomer's README stays short; what moved out is one click away: every page under
    docs/ is linked from docs/README.md, which the README links, and no link is dead."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "docs/README.md" in readme
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert rel == "README.md" or f"({rel})" in index, f"docs/README.md does not link {rel}"
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([\w./-]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith("/"):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: dead link {target}"
