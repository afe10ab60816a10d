"""The operator's own settings: built once by the CLI, read by the handlers, never changed."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """How this operator process watches and reconciles (`sftjob-operator --help`)."""

    namespaces: tuple[str, ...] | None = None
    """Namespaces to watch (globs allowed); None: the whole cluster."""
    watch_server_timeout: int = 300
    """Server-side watch timeout in seconds, so that watches are renewed and never stall."""
    peering_name: str | None = None
    """kopf peering object to coordinate through; None: standalone (see --peering)."""

    @property
    def exact_namespaces(self) -> bool:
        """Only exact namespace names (no globs): kopf then needs no namespace scanning."""
        return bool(self.namespaces) and not any(c in n for n in self.namespaces for c in "*?[")
