"""The operator's vocabularies as enums: a job's phase, a pod's phase and a restart's cause.

Spelled once here; everything else names the members. `StrEnum` members are the strings
they stand for, so they go to the API server, into logs and into metrics labels as is.
"""
from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    """status.phase of an SFTJob."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


class PodPhase(enum.StrEnum):
    """status.phase of a Pod, as the API server reports it."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


POD_FINISHED = (PodPhase.SUCCEEDED, PodPhase.FAILED)


class RestartCause(enum.StrEnum):
    """Why a gang restarted: a failure spends backoffLimit, a preemption preemptionLimit."""

    FAILURE = "failure"
    PREEMPTION = "preemption"
