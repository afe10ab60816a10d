"""The operator's own settings: built once by the CLI, read by the handlers, never changed.

`cli.settings_from_args` is the only place command-line arguments are read; everything
after it (kopf's configuration, the metrics and liveness servers, leader election, the
startup handler) reads this object. The startup handler refuses to run without it rather
than fall back to defaults, so there is one way in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .leader import Config as LeaderConfig


@dataclass(frozen=True)
class Settings:
    """How this operator process watches and reconciles (`sftjob-operator --help`)."""

    namespaces: tuple[str, ...] | None = None
    """Namespaces to watch (globs allowed); None: the whole cluster."""
    watch_server_timeout: int = 300
    """Server-side watch timeout in seconds, so that watches are renewed and never stall."""
    peering_name: str | None = None
    """kopf peering object to coordinate through; None: standalone (see --peering)."""
    identity: str = ""
    """This replica's identity, for kopf and the leader Lease (pod or host name + suffix)."""
    metrics_port: int = 8080
    """Prometheus port; 0: no metrics server."""
    liveness_port: int = 8081
    """Port of GET /healthz; 0: no liveness endpoint."""
    leader_election: LeaderConfig | None = None
    """The Lease to hold before acting; None: act at once (a single replica)."""
    job_network_policy: bool = False
    """Give every job a NetworkPolicy (builders.build_network_policy): ranks reach each other,
    `trainer_metrics_from` reaches the metrics port, nothing else reaches a training pod."""
    trainer_metrics_from: tuple[dict[str, Any], ...] = ()
    """NetworkPolicy peers allowed to the trainers' metrics port (the operator, monitoring)."""
    log_format: Literal["plain", "json"] = "plain"
    verbose: bool = False

    @property
    def exact_namespaces(self) -> bool:
        """Only exact namespace names (no globs): kopf then needs no namespace scanning."""
        names = self.namespaces or ()
        return bool(names) and not any(c in n for n in names for c in "*?[")
