"""The typed status: what an older operator stored parses, unknown fields are refused, and
the merge patch deletes exactly the fields that were cleared."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from sftjob_operator import status
from sftjob_operator.status import SFTJobStatus

pytestmark = pytest.mark.unit

# A status as the operator before the typed model wrote it: every field it ever set.
STORED = {
    "phase": "Restarting", "observedGeneration": 3, "message": "Preempted: rank 1; restarting the whole gang in 10s",
    "conditions": [{"type": "Ready", "status": "False", "reason": "RestartingAfterPreemption", "message": "m",
                    "lastTransitionTime": "2026-01-01T12:00:00Z", "observedGeneration": 3}],
    "restarts": {"failures": 0, "preemptions": 1, "total": 1},
    "progress": {"step": 12, "totalSteps": 40, "epoch": 0, "loss": 2, "tokensPerSecond": 1234.6,
                 "lastCheckpointStep": 10, "summary": "12/40", "lastStepTime": "2026-01-01T11:59:00Z",
                 "updatedTime": "2026-01-01T11:59:30Z"},
    "startTime": "2026-01-01T11:00:00Z",
    "output": {"checkpointsUri": "s3://runs/team-a/tiny/uid/checkpoints"},
    "attempt": 2, "launchedAttempt": 1, "launchTime": "2026-01-01T11:00:00Z",
    "restartAfter": "2026-01-01T12:00:10Z",
    "kopf": {"progress": {}},   # kopf's own bookkeeping under its default storage
}


def test_a_status_stored_by_the_old_operator_parses_and_round_trips():
    st = status.parse(STORED)
    assert (st.phase, st.attempt, st.restarts.preemptions, st.progress.loss) == ("Restarting", 2, 1, 2.0)
    assert status.dump(st) == {k: v for k, v in STORED.items() if k != "kopf"}


@pytest.mark.parametrize("raw", [
    {"phase": "Done"},                                      # not a phase
    {"attempt": "two"},
    {"progress": {"step": "three", "futureField": 1}},      # an unknown field does not hide a bad value
])
def test_invalid_status_values_are_rejected(raw):
    with pytest.raises(ValidationError):
        status.parse(raw)


def test_fields_a_newer_operator_wrote_are_read_around_and_left_alone():
    """A status field this version does not know (a newer operator under a newer CRD) made
    every pass of the job raise. It is left out of the model, and never deleted on the wire."""
    raw = {**STORED, "goodput": {"ratio": 0.9}, "progress": {**STORED["progress"], "percent": 30},
           "restarts": {**STORED["restarts"], "resizes": 2},
           "conditions": [{**STORED["conditions"][0], "severity": "Info"}]}
    st = status.parse(raw)
    assert (st.phase, st.attempt, st.progress.step, st.restarts.preemptions) == ("Restarting", 2, 12, 1)
    st.phase = "Running"
    patch = status.merge_patch(raw, st)
    assert "goodput" not in patch and "kopf" not in patch   # not nulled: not ours to delete
    assert patch["phase"] == "Running"


def test_assigning_an_unknown_field_is_rejected():
    st = SFTJobStatus()
    with pytest.raises(ValueError):
        st.restart_afterr = "x"  # type: ignore[attr-defined]
    with pytest.raises(ValidationError):
        st.phase = "Done"  # type: ignore[assignment]


@pytest.mark.parametrize("old, new, patch", [
    # a new job: defaults written, nothing to delete
    (None, SFTJobStatus(phase="Pending"),
     {"phase": "Pending", "conditions": [], "restarts": {"failures": 0, "preemptions": 0, "total": 0},
      "progress": {}, "output": {}, "attempt": 0}),
    # a cleared field is deleted with an explicit null (a merge patch keeps what it does not name)
    ({"phase": "Restarting", "attempt": 1, "restartAfter": "t"}, SFTJobStatus(phase="Running", attempt=1),
     {"restartAfter": None, "phase": "Running", "conditions": [],
      "restarts": {"failures": 0, "preemptions": 0, "total": 0}, "progress": {}, "output": {}, "attempt": 1}),
    # kopf's key is not ours: never deleted
    ({"kopf": {"x": 1}, "startTime": "t"}, SFTJobStatus(),
     {"startTime": None, "conditions": [], "restarts": {"failures": 0, "preemptions": 0, "total": 0},
      "progress": {}, "output": {}, "attempt": 0}),
])
def test_merge_patch(old, new, patch):
    assert status.merge_patch(old, new) == patch


def test_fields_patch_sets_only_the_named_fields_and_checks_them():
    assert status.fields_patch(launched_attempt=2, launch_time="t") == {"launchedAttempt": 2, "launchTime": "t"}
    with pytest.raises(ValidationError):
        status.fields_patch(launched_atempt=2)


def test_times_round_trip_in_the_status_format():
    t = status.parse_time("2026-01-01T12:00:05Z")
    assert status.iso(t) == "2026-01-01T12:00:05Z" and status.parse_time(None) is None


def test_restart_counts_keep_their_total():
    counts = status.RestartCounts()
    for cause in ("failure", "preemption", "preemption"):
        counts.count(cause)
    assert (counts.failures, counts.preemptions, counts.total) == (1, 2, 3)
