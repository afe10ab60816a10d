"""Phases and restart causes are spelled once (phases.py): no raw phase string elsewhere in
the operator. Condition types, Kueue's reasons and API enums that happen to share a word
are named constants or typed fields, which this reads as such."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "sftjob_operator"
WORD = re.compile(r'"(Pending|Running|Restarting|Suspended|Succeeded|Failed|Unknown|failure|preemption)"')
# A named constant or enum member (`RUNNING = "Running"`), or a field's Literal of API values.
DEFINITION = re.compile(r'^\s*[A-Z][A-Z0-9_]*(: \w+)? = "|Literal\[')  # a constant, typed or not


def test_no_raw_phase_or_cause_string_outside_the_enums():
    found = []
    for path in sorted(OPERATOR.glob("*.py")):
        if path.name == "phases.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if WORD.search(code) and not DEFINITION.search(code):
                found.append(f"{path.name}:{n}: {line.strip()}")
    assert not found, "use sftjob_operator.phases:\n" + "\n".join(found)
