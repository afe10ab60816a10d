"""Fencing: a rank of an attempt that is no longer current never commits, prunes or
publishes the export.

Why: a node cut off from the API server can keep its trainer running while it still
reaches the store. The operator has long since started the next attempt (and force-deleted
the old pod, which the kubelet never hears of), so two attempts write the same prefix: both
commit and prune checkpoints, both rewrite ``hf/``. Nothing on the node can tell the old
rank that it is stale, so the store has to.

The design rests on what object stores offer, a conditional write of one object
(``If-None-Match: *`` to create it, ``If-Match: <etag>`` to replace exactly what was read;
AWS S3 and MinIO both support them), and on the attempt number the operator owns
(``SFTJOB_ATTEMPT``, one more for every gang it starts):

- **Claim.** At start, rank 0 of an attempt reads ``owner.json`` at the output root and
  replaces it, conditionally on what it read, with its own attempt number and run token. An
  attempt never claims over a higher attempt number; it stops instead. Two claims racing are
  serialised by the condition: the loser reads again and decides again.
- **Check.** Before each write that changes what a resume or a reader sees (the commit of a
  checkpoint, pruning, publishing the export), rank 0 reads ``owner.json`` again and stops
  with reason ``Superseded`` when the token is no longer its own.

What it does not cover: a stale rank that passed its check a moment before the new attempt
claimed may finish that one write (a commit marker of a checkpoint it fully wrote, which is
a valid checkpoint; one file of an export). The window is one request long, and the next
check stops it. The other ranks only write their own shards and reports, which a commit
counts only for its own run token (``checkpoint.gather_reports``).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Protocol

from sftjob_contract import env as E
from sftjob_contract.layout import OWNER

from .errors import Superseded

log = logging.getLogger(__name__)

CLAIM_TRIES = 20


class ConditionalStore(Protocol):
    """The two object operations fencing needs (``LocalDir`` and ``S3Prefix`` have them)."""

    uri: str

    def get_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """The object's bytes and its version tag (an ETag); None when there is none."""

    def put_if(self, rel: str, body: bytes, tag: str | None) -> bool:
        """Write ``body`` only if the object is still at version ``tag`` (None: only if it
        does not exist); False when that condition no longer holds."""


def attempt_from_env() -> int:
    """The operator's attempt number for this gang; 0 outside the operator."""
    try:
        return int(os.environ.get(E.ATTEMPT) or 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class Owner:
    attempt: int
    token: str

    def encode(self) -> bytes:
        return json.dumps({"attempt": self.attempt, "token": self.token}).encode()


def _read(store: ConditionalStore) -> tuple[Owner | None, str | None]:
    found = store.get_tagged(OWNER)
    if found is None:
        return None, None
    body, tag = found
    try:
        raw = json.loads(body)
        return Owner(int(raw["attempt"]), str(raw["token"])), tag
    except (ValueError, KeyError, TypeError):
        return None, tag  # unreadable: claimed over, conditionally on exactly that content


class Fence:
    """Rank 0's claim on an output prefix; ``check`` before every shared write."""

    def __init__(self, store: ConditionalStore, me: Owner):
        self.store, self.me = store, me

    @classmethod
    def claim(cls, store: ConditionalStore, attempt: int, token: str) -> Fence:
        me = Owner(attempt, token)
        for _ in range(CLAIM_TRIES):
            owner, tag = _read(store)
            if owner is not None and owner.attempt > attempt:
                raise Superseded(f"attempt {owner.attempt} already owns {store.uri}; this attempt ({attempt}) "
                                 "is stale and stops before writing anything")
            if store.put_if(OWNER, me.encode(), tag):
                log.info("attempt %d owns %s", attempt, store.uri)
                return cls(store, me)
        raise Superseded(f"could not claim {store.uri}: {CLAIM_TRIES} conditional writes lost to other attempts")

    def check(self, what: str) -> None:
        owner, _ = _read(self.store)
        if owner != self.me:
            who = f"attempt {owner.attempt}" if owner else "another writer"
            raise Superseded(f"{who} has taken over {self.store.uri}; this attempt ({self.me.attempt}) is stale "
                             f"and does not {what}")
