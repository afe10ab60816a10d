"""Leader-election flags and defaults of `sftjob-operator`, without a cluster."""
from __future__ import annotations

import pytest

from sftjob_operator import cli, leader
from datetime import UTC

pytestmark = pytest.mark.unit


def test_flags_and_defaults():
    args = cli._parser().parse_args(["-A"])
    assert args.leader_elect is None  # auto: on in a pod, off elsewhere
    assert (args.leader_election_lease_duration, args.leader_election_renew_deadline,
            args.leader_election_retry_period) == (15.0, 10.0, 2.0)
    assert args.leader_election_name == "sftjob-operator"
    assert cli._parser().parse_args(["-A", "--leader-elect"]).leader_elect is True
    assert cli._parser().parse_args(["-A", "--no-leader-elect"]).leader_elect is False


def test_in_cluster_detection(monkeypatch, tmp_path):
    ns_file = tmp_path / "namespace"
    monkeypatch.setattr(leader, "SA_NAMESPACE_FILE", str(ns_file))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert not leader.in_cluster() and leader.default_namespace() is None
    ns_file.write_text("sftjob-system\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert leader.in_cluster() and leader.default_namespace() == "sftjob-system"
    monkeypatch.setenv("POD_NAMESPACE", "from-downward-api")
    assert leader.default_namespace() == "from-downward-api"


def test_identity_is_pod_name_plus_random_suffix(monkeypatch):
    monkeypatch.setenv("POD_NAME", "sftjob-operator-7d9f-abcde")
    a, b = leader.default_identity(), leader.default_identity()
    assert a.startswith("sftjob-operator-7d9f-abcde_") and a != b


def test_leader_elect_needs_a_namespace(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(leader, "SA_NAMESPACE_FILE", str(tmp_path / "absent"))
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["-A", "--leader-elect"])
    assert exc.value.code == 2 and "--leader-election-namespace" in capsys.readouterr().err


def test_unsafe_timings_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["-A", "--leader-elect", "--leader-election-namespace", "x",
                  "--leader-election-renew-deadline", "20"])
    assert "retry period < renew deadline < lease duration" in capsys.readouterr().err


def test_micro_time_always_has_six_fractional_digits():
    from datetime import datetime

    assert leader._micro_time(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2026-01-02T03:04:05.000000Z"


def test_config_rejects_unsafe_timings():
    with pytest.raises(ValueError):
        leader.Config(namespace="x", lease_duration=10, renew_deadline=10, retry_period=2)
    with pytest.raises(ValueError):
        leader.Config(namespace="x", lease_duration=15, renew_deadline=2, retry_period=2)
    assert leader.Config(namespace="x").identity  # pod/host name + random suffix


def test_runs_as_a_uid_without_a_passwd_entry(monkeypatch):
    """The image runs as uid 65532, which has no /etc/passwd entry: kopf's own peering identity
    (getpass.getuser()) raised KeyError and the operator pod crash-looped on a real kubelet.
    The operator hands kopf the pod's identity instead."""
    import getpass

    import kopf

    def no_passwd_entry():
        raise KeyError("getpwuid(): uid not found: 65532")

    seen = {}
    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    monkeypatch.setattr("sftjob_operator.metrics.serve", lambda port: None)
    monkeypatch.setenv("POD_NAME", "sftjob-operator-7d9f-abcde")
    assert cli.main(["-A", "--no-leader-elect", "--liveness-port", "0"]) == 0
    assert seen["identity"].startswith("sftjob-operator-7d9f-abcde")
