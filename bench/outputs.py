"""What the benchmarks read of a trainer run's output directory, by the contract's names
(sftjob_contract.layout), so that a renamed file breaks them loudly rather than silently."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from sftjob_contract import layout


def metric_rows(out: Path) -> list[dict[str, Any]]:
    """Every row of the run's metrics file (none when the run wrote none)."""
    path = out / layout.METRICS_FILE
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def step_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of optimizer steps (those with a loss), in the order they were written."""
    return [r for r in metric_rows(out) if "loss" in r]


def drop_checkpoints_and_exports(out: Path) -> None:
    """Free the disk a run used for what a benchmark does not read: its checkpoints and exports."""
    shutil.rmtree(out / layout.CHECKPOINTS, ignore_errors=True)
    shutil.rmtree(out / layout.HF, ignore_errors=True)
