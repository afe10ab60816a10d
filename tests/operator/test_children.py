"""The job's Service and ConfigMap: whose an existing object of their name is, and what a
refused create means (rejections.from_child_error, child_owner, name_taken)."""
from __future__ import annotations

import pytest

from sftjob_operator import rejections

pytestmark = pytest.mark.unit

SERVICE = {"kind": "Service", "metadata": {"name": "tiny", "namespace": "team-a"}}
CONFIG = {"kind": "ConfigMap", "metadata": {"name": "tiny-config", "namespace": "team-a"}}


def _existing(kind: str, *owners: dict) -> dict:
    return {"kind": kind, "metadata": {"name": "tiny", "namespace": "team-a", "ownerReferences": list(owners)}}


@pytest.mark.parametrize("owners, verdict", [
    ([{"kind": "SFTJob", "name": "tiny", "uid": "u1"}], "ours"),
    ([{"kind": "SFTJob", "name": "tiny", "uid": "u0"}], "previous"),      # a deleted job of the same name
    ([], "taken"),                                                        # a user's own object
    ([{"kind": "Deployment", "name": "web", "uid": "u9"}], "taken"),
    ([{"kind": "SFTJob", "name": "other", "uid": "u5"}], "taken"),
])
def test_whose_an_existing_child_is(owners, verdict):
    assert rejections.child_owner(_existing("ConfigMap", *owners), "tiny", "u1") == verdict


def test_a_taken_name_fails_the_job_naming_the_object_and_what_to_do():
    rej = rejections.name_taken(_existing("Service", {"kind": "Deployment", "name": "web", "uid": "u9"}))
    assert rej.permanent and rej.reason == "NameTaken"
    assert "Service team-a/tiny" in rej.message and "Deployment web" in rej.message
    assert "metadata.name" in rej.message


def _quota(requested: str, used: str, limited: str) -> dict:
    return {"kind": "Status", "code": 403, "message": f'services "tiny" is forbidden: exceeded quota: q, '
            f"requested: {requested}, used: {used}, limited: {limited}"}


@pytest.mark.parametrize("status, body, manifest, reason, permanent, words", [
    (403, _quota("services=1", "services=3", "services=3"), SERVICE, "QuotaExceeded", False, "waiting"),
    (403, _quota("services=1", "services=0", "services=0"), SERVICE, "QuotaExceeded", True, "allows no Service"),
    (403, {"message": 'admission webhook "policy" denied the request: no headless services'}, SERVICE,
     "ObjectRejected", True, "denied the request"),
    (422, {"message": 'ConfigMap "tiny-config" is invalid: []: Too long: must have at most 1048576 bytes'}, CONFIG,
     "ObjectRejected", True, "spec.data"),
])
def test_a_refused_service_or_config_map_fails_or_waits_like_a_pod(status, body, manifest, reason, permanent, words):
    rej = rejections.from_child_error(status, body, manifest)
    assert (rej.reason, rej.permanent) == (reason, permanent)
    assert words in rej.message and manifest["metadata"]["name"] in rej.message
