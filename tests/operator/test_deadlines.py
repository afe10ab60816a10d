"""The run policy's clocks, table-driven: seconds left (<= 0: passed) or None (none runs)."""
from __future__ import annotations

import pytest
from .op_testkit import T0, at

from sftjob_operator import deadlines

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("started, limit, now, left", [
    (None, 60, at(100), None),        # never ran: the clock has not started
    (T0, None, at(100), None),        # no deadline
    (T0, 60, at(10), 50.0),
    (T0, 60, at(60), 0.0),            # due now
    (T0, 60, at(90), -30.0),
])
def test_active_deadline(started, limit, now, left):
    assert deadlines.active_left(started, limit, now) == left


@pytest.mark.parametrize("launched, admitted, since, what", [
    (T0, None, T0, "creation"),
    (T0, at(-5), T0, "creation"),                 # admitted before the pods existed
    (T0, at(30), at(30), "admission by Kueue"),   # queued time is not start-up time
])
def test_startup_clock_starts_at_creation_or_admission(launched, admitted, since, what):
    assert deadlines.startup_since(launched, admitted) == (since, what)


@pytest.mark.parametrize("since, limit, now, left", [
    (T0, 600, at(100), 500.0),
    (T0, 600, at(600), 0.0),
    (at(30), 600, at(700), -70.0),
])
def test_startup_deadline(since, limit, now, left):
    assert deadlines.startup_left(since, limit, now) == left


@pytest.mark.parametrize("limit, last_step, launched, step, total, now, left", [
    (None, at(10), T0, 5, 40, at(100), None),      # no watchdog
    (60, None, T0, None, 40, at(100), None),       # no step yet: a long start-up is not a hang
    (60, at(10), at(20), 5, 40, at(100), None),    # the last step was a previous attempt's
    (60, at(10), T0, 40, 40, at(1000), None),      # after the last step: export may take long
    (60, at(10), T0, 5, 40, at(40), 30.0),
    (60, at(10), T0, 5, 40, at(100), -30.0),       # stuck: restart the gang
    (60, at(10), T0, 5, None, at(100), -30.0),     # total unknown: still armed
])
def test_progress_deadline(limit, last_step, launched, step, total, now, left):
    assert deadlines.progress_left(limit, last_step, launched, step, total, now) == left


@pytest.mark.parametrize("last_step, observing_since, now, left", [
    (at(10), at(600), at(620), 40.0),    # operator back at 600 after an outage: 60 s from then
    (at(10), at(600), at(661), -1.0),    # ... and a gang still stuck a full deadline later restarts
    (at(10), at(5), at(40), 30.0),       # watching since before the last step: the step counts
])
def test_progress_deadline_counts_only_what_this_operator_saw(last_step, observing_since, now, left):
    assert deadlines.progress_left(60, last_step, T0, 5, 40, now, observing_since) == left
