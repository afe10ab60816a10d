"""The operator's typed settings, as the CLI builds them."""
from __future__ import annotations

import dataclasses

import pytest

from sftjob_operator.settings import Settings

pytestmark = pytest.mark.unit


def test_exact_namespaces_skip_kopf_scanning_globs_do_not():
    assert Settings(namespaces=("team-a", "team-b")).exact_namespaces
    assert not Settings(namespaces=("team-*",)).exact_namespaces
    assert not Settings().exact_namespaces  # the whole cluster


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().watch_server_timeout = 5  # type: ignore[misc]
