"""The one poll every cluster wait is built on (hack.localcluster.kube.wait_for: the chaos harness,
the test fixtures' wait_for, namespaces and CRDs); no cluster needed."""
from __future__ import annotations

import pytest

from hack.localcluster.kube import ApiError, wait_for
from tests.fixtures.cluster import wait_for as wait_in_test

pytestmark = pytest.mark.unit


def answers(*results):
    """A predicate that returns (or raises) each of `results` in turn, then the last forever."""
    it = iter(results)
    last = []

    def pred():
        r = next(it, last[0] if last else None)
        last[:] = [r]
        if isinstance(r, Exception):
            raise r
        return r

    return pred


def test_errors_and_falsy_answers_are_not_yet_and_the_first_truthy_one_is_returned():
    pred = answers(ApiError(503, "starting", "GET", "/x"), None, [], {"ready": 1})
    assert wait_for(pred, 5, "x", interval=0.01) == {"ready": 1}


def test_a_timeout_names_what_and_the_last_error():
    pred = answers(None, ApiError(404, "not found", "GET", "/apis/x"))
    with pytest.raises(TimeoutError, match=r"timed out after 0s waiting for the thing \(.*404"):
        wait_for(pred, 0.05, "the thing", interval=0.01)
    # a spent budget still asks once: a wait that starts late does not fail what is already true
    assert wait_for(lambda: "yes", -1, "x") == "yes"


def test_in_a_test_a_timeout_fails_it_as_an_assertion():
    with pytest.raises(AssertionError, match="waiting for the pod"):
        wait_in_test(lambda: None, timeout=0.05, interval=0.01, what="the pod")
