"""What the tracking backends (track_*.py) and the Tracker (tracking.py) share: who the run
is, and the names both sides agree on. Apart so that the backends never import the Tracker."""
from __future__ import annotations

from dataclasses import dataclass

ALL = "*"   # a backend that knows one last step for all its metrics answers it under this name
OUTPUT_URI = "output_uri"   # the exported model's location, as a tag (MLflow) or summary value (W&B)


@dataclass(frozen=True)
class RunInfo:
    """Who the run is: ``identity`` is the same for every attempt of one job and differs
    between jobs (a re-created job with the same name has a new uid, so a new run)."""

    identity: str
    output_dir: str
    name: str
