"""The operator's typed settings, as the CLI builds them (the only place arguments are read)."""
from __future__ import annotations

import asyncio
import dataclasses

import kopf
import pytest

from sftjob_operator import cli, handlers, leader
from sftjob_operator.settings import Settings

pytestmark = pytest.mark.unit


def test_exact_namespaces_skip_kopf_scanning_globs_do_not():
    assert Settings(namespaces=("team-a", "team-b")).exact_namespaces
    assert not Settings(namespaces=("team-*",)).exact_namespaces
    assert not Settings().exact_namespaces  # the whole cluster


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().watch_server_timeout = 5  # type: ignore[misc]


def _settings(*argv: str) -> Settings:
    return cli.settings_from_args(cli._parser().parse_args(list(argv)))


@pytest.mark.parametrize("argv, expected", [
    (["-A"], {"namespaces": None, "metrics_port": 8080, "liveness_port": 8081, "watch_server_timeout": 300,
              "peering_name": None, "leader_election": None, "log_format": "plain", "verbose": False}),
    (["-n", "team-a", "-n", "team-*", "--metrics-port", "0", "--log-format", "json", "-v"],
     {"namespaces": ("team-a", "team-*"), "metrics_port": 0, "log_format": "json", "verbose": True}),
    (["-A", "--watch-timeout", "60", "--peering", "p", "--leader-election-id", "me"],
     {"watch_server_timeout": 60, "peering_name": "p", "identity": "me", "job_network_policy": False}),
    (["-A", "--job-network-policy", "--trainer-metrics-from", '[{"namespaceSelector": {}}]'],
     {"job_network_policy": True, "trainer_metrics_from": ({"namespaceSelector": {}},)}),
])
def test_settings_from_args(argv, expected, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)   # not in a pod: no election by default
    got = _settings(*argv)
    assert {k: getattr(got, k) for k in expected} == expected


def test_one_identity_for_kopf_and_the_lease():
    got = _settings("-A", "--leader-elect", "--leader-election-namespace", "ops", "--leader-election-id", "me")
    assert got.identity == "me" and got.leader_election == leader.Config(namespace="ops", identity="me")
    generated = _settings("-A", "--leader-elect", "--leader-election-namespace", "ops")
    assert generated.identity and generated.leader_election.identity == generated.identity


@pytest.mark.parametrize("argv, error", [
    ([], "choose a scope"),
    (["-A", "--leader-elect", "--leader-election-namespace", "x", "--leader-election-renew-deadline", "20"],
     "retry period < renew deadline < lease duration"),
    (["-A", "--trainer-metrics-from", "{not json"], "--trainer-metrics-from is not JSON"),
    (["-A", "--trainer-metrics-from", '{"a": 1}'], "a JSON list of NetworkPolicy peers"),
])
def test_settings_that_cannot_run_are_refused(argv, error, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match=error):
        _settings(*argv)


def test_startup_refuses_to_run_without_the_clis_settings():
    """No silent defaults: the settings the CLI built are the only way in."""
    with pytest.raises(kopf.PermanentError, match="no operator settings"):
        asyncio.run(handlers.startup(settings=kopf.OperatorSettings(), memo=kopf.Memo()))
