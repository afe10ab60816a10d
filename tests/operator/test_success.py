"""Success policy: what the status says once every rank exited 0."""
from __future__ import annotations

import pytest

from sftjob_operator import success
from sftjob_operator.status import Progress

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("before, after", [
    # the last scrape predates the final steps: the run is shown complete
    (Progress(step=37, total_steps=40, summary="37/40", loss=1.5), Progress(step=40, total_steps=40,
                                                                        summary="40/40", loss=1.5)),
    (Progress(step=40, total_steps=40, summary="40/40"), Progress(step=40, total_steps=40, summary="40/40")),
    # never scraped (a run shorter than one scrape): nothing to claim
    (Progress(), Progress()),
    (Progress(step=3), Progress(step=3)),
])
def test_final_progress(before, after):
    assert success.final_progress(before) == after
