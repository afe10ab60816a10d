"""The SFTJob status as a typed model: what reconcile reads, decides and writes.

The operator is the status's only writer, and the status is where it keeps everything it
must not lose when it restarts (attempt numbers, restart times): no state lives in the
operator's memory. A pass parses the stored status once (`parse`), changes the model, and
writes it back as one JSON merge patch (`merge_patch`), camelCase as on the wire.

Unknown fields are never written: the models forbid extra keys on assignment (a misspelled
field is a ValidationError in the operator, never a key stored silently), and the CRD's
status schema does not preserve unknown fields. Reading is lenient about one thing only: a
field this operator version does not know (written by a newer operator under a newer CRD,
during an upgrade or a rollback) is left out of the model and left alone on the wire, so
that every pass of the job does not fail on it. A value of the wrong type is still an error.
Times are strings in the one format the status has always used (`iso`, `parse_time`).
"""
from __future__ import annotations

import copy
from datetime import datetime, UTC
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from .phases import Phase, RestartCause

# Status keys the operator does not own: kopf's default storage keeps handler progress in
# `status.kopf`; this operator keeps it in annotations (handlers.startup), but a status
# written under kopf's defaults may still carry it. It is neither parsed nor ever deleted.
FOREIGN_KEYS = ("kopf",)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class StatusModel(BaseModel):
    """Base of the status models: camelCase on the wire, unknown keys rejected, every
    assignment validated (a pass edits the model in place)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              validate_assignment=True, use_enum_values=True)




ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(StatusModel):
    """A condition in Kubernetes form (metav1.Condition)."""

    model_config = ConfigDict(frozen=True)   # replaced whole (conditions.set_condition), never edited

    type: str = Field(description="Ready, Running, Restarting, Suspended, Succeeded, Failed, Reconciling or Stalled.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason, one of the constants in sftjob_operator.conditions.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation this was computed from.")


class RestartCounts(StatusModel):
    """Gang restarts, by cause."""

    failures: int = Field(default=0, description="Restarts after a rank failed (exit 1 or 3..127, OOM-killed, "
                          "hung); spends runPolicy.backoffLimit.")
    preemptions: int = Field(default=0,
                             description="Restarts after a pod was preempted, evicted, deleted or lost its node.")
    total: int = Field(default=0, description="failures + preemptions.")

    def count(self, cause: RestartCause) -> None:
        """Count one gang restart by its cause."""
        if cause == RestartCause.FAILURE:
            self.failures += 1
        else:
            self.preemptions += 1
        self.total = self.failures + self.preemptions


class ResizeStatus(StatusModel):
    """Resizes of an elastic job's gang (elastic.py), counted apart from restarts."""

    count: int = Field(default=0, description="Times the gang changed size (a shrink for lost capacity, a grow when "
                       "it returned, or an edit of resources.nodes). Neither failures nor preemptions.")
    last_reason: str | None = Field(default=None, description="Why the last resize happened (CapacityLost, "
                                    "NotAllScheduled, CapacityReturned or SpecChanged).")
    last_message: str | None = Field(default=None, description="The last resize, in words.")
    last_from: int | None = Field(default=None, description="Pods before the last resize.")
    last_to: int | None = Field(default=None, description="Pods after the last resize.")
    last_time: str | None = Field(default=None, description="When the last resize was decided (RFC 3339).")


class CheckpointRequest(StatusModel):
    """A planned stop waiting for the checkpoint it asked the trainer for (stop_request.py)."""

    attempt: int = Field(description="The attempt whose rank 0 was asked.")
    step: int = Field(description="The step the trainer reported when asked; the stop waits for a committed "
                      "checkpoint at or past it.")
    time: str = Field(description="When it was asked (RFC 3339).")
    reason: str = Field(description="The planned stop it is for: a suspend, or a resize.")
    failed: str | None = Field(default=None, description="Why the request did not reach the trainer, when it "
                               "did not; the stop then goes ahead (the pods still checkpoint on SIGTERM).")


class SourceReport(StatusModel):
    """The trainer's preflight report of one training source, read once it has scanned the data."""

    name: str = Field(description="The source: data.sources[].name, or train for data.trainFiles.")
    rows: int | None = Field(default=None, description="Rows read.")
    usable_rows: int | None = Field(default=None, description="Rows that train.")
    dropped_rows: int | None = Field(default=None, description="Rows without a trainable token (an empty "
                                     "response, or one truncated away), left out.")
    truncated_rows: int | None = Field(default=None, description="Rows cut to data.maxLength.")
    tokens: int | None = Field(default=None, description="Tokens of the usable rows, after truncation.")
    samples_per_epoch: int | None = Field(default=None, description="Its weight's share of an epoch, in samples.")


class Progress(StatusModel):
    """Training progress mirrored from the rank-0 trainer's metrics endpoint."""

    step: int | None = Field(default=None, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps in the whole run.")
    epoch: int | None = Field(default=None, description="Current epoch (0-based).")
    loss: float | None = Field(default=None, description="Latest training loss (absent while it is not finite).")
    non_finite_loss: str | None = Field(
        default=None, description="The latest loss when it is not finite (nan, +inf or -inf); loss is then absent.")
    skipped_steps: int | None = Field(
        default=None, description="Steps of the current attempt skipped because their loss or gradient was not "
        "finite (training.maxNonFiniteSteps in a row end the run).")
    failed_checkpoint_commits: int | None = Field(
        default=None, description="Checkpoint commits of the current attempt that failed (retried; "
        "trainer.maxFailedCommits in a row end the run). lastCheckpointStep counts only committed ones.")
    tokens_per_second: float | None = Field(default=None, description="Latest training throughput (all ranks).")
    val_loss: float | None = Field(default=None, description="Latest validation loss.")
    best_val_loss: float | None = Field(default=None, description="Lowest validation loss so far (what "
                                        "output.export best exports; early stopping compares against it).")
    best_val_step: int | None = Field(default=None, description="The step of bestValLoss.")
    last_checkpoint_step: int | None = Field(default=None, description="Step of the newest committed checkpoint.")
    last_checkpoint_time: str | None = Field(default=None, description="When it committed (RFC 3339).")
    steps_since_checkpoint: int | None = Field(
        default=None, description="Steps trained since the newest committed checkpoint: the work a preemption "
        "without a SIGTERM checkpoint (a lost node, SIGKILL) would cost now.")
    summary: str | None = Field(default=None, description="step/totalSteps, as shown by kubectl get.")
    percent: float | None = Field(default=None, description="Percent of the run's steps done.")
    seconds_per_step: float | None = Field(
        default=None, description="Measured pace: a running average over readings in which the step advanced "
        "(restart gaps left out).")
    estimated_remaining_seconds: int | None = Field(
        default=None, description="Estimated time to the last step: steps left times secondsPerStep (future "
        "restarts not predicted).")
    training_seconds: float | None = Field(
        default=None, description="Wall time in which the step advanced, over all attempts.")
    steps_lost: int | None = Field(default=None, description="Steps trained and then lost to restarts (redone).")
    goodput: float | None = Field(
        default=None, description="trainingSeconds over the wall time since the job was created (0 to 1).")
    sources: list[SourceReport] | None = Field(
        default=None, description="The preflight report per training source (data.sources, or one source train): "
        "what was read, kept, dropped and truncated, and each source's samples per epoch.")
    reading_attempt: int | None = Field(default=None, description="The attempt whose pods gave the last reading.")
    last_step_time: str | None = Field(default=None, description="When step last advanced (RFC 3339).")
    updated_time: str | None = Field(default=None, description="When these values were last read (RFC 3339).")


class OutputStatus(StatusModel):
    """Where the results are."""

    uri: str | None = Field(default=None, description="The Hugging Face model the current gang exports (set at its "
                            "launch from the spec it runs; written once the job succeeds).")
    checkpoints_uri: str | None = Field(default=None, description="Where the job's checkpoints are written.")


class SFTJobStatus(StatusModel):
    """Observed state of an SFTJob."""

    phase: Phase | None = Field(default=None,
                                description="Pending, Running, Restarting, Suspended, Succeeded or Failed.")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="Current conditions.")
    restarts: RestartCounts = Field(default_factory=RestartCounts, description="Gang restarts by cause.")
    progress: Progress = Field(default_factory=Progress, description="Training progress.")
    start_time: str | None = Field(default=None, description="When all pods of the job first ran (reset on suspend).")
    completion_time: str | None = Field(default=None, description="When the job succeeded or failed.")
    output: OutputStatus = Field(default_factory=OutputStatus, description="Where the results are.")
    nodes: int | None = Field(default=None, description="Pods in the current gang: the size it was started at "
                              "(an elastic job may run below spec.resources.nodes).")
    sized_attempt: int | None = Field(default=None, description="The attempt `nodes` was decided for.")
    checkpoint_request: CheckpointRequest | None = Field(
        default=None, description="Present while a suspend or resize waits for the checkpoint it asked the "
        "trainer for, before the pods are stopped.")
    resizes: ResizeStatus | None = Field(default=None, description="Resizes of the gang (elastic jobs); absent "
                                         "until the first.")
    attempt: int = Field(
        default=0,
        description="Gang generation: grows whenever the pods are torn down (restart or suspend). Pods "
        "carry it in the sftjob.io/attempt label so that stale pods are never taken for the current gang.",
    )
    launched_attempt: int | None = Field(default=None, description="The attempt whose pods were all created.")
    launch_time: str | None = Field(default=None, description="When the current attempt's pods were created.")
    launched_generation: int | None = Field(
        default=None, description="The metadata.generation the current attempt's pods were built from.")
    launched_spec: dict[str, str] | None = Field(
        default=None, description="A digest of each restart-applied spec section the current attempt was built from "
        "(edits.py): an edit since then waits for the next gang (condition EditPending).")
    restart_after: str | None = Field(default=None, description="Earliest time of the next gang start (back-off).")
    message: str | None = Field(default=None, description="Why the job is in its phase.")


def iso(t: datetime) -> str:
    """A status time: UTC, whole seconds (RFC 3339)."""
    return t.astimezone(UTC).strftime(TIME_FORMAT)


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.strptime(s, TIME_FORMAT).replace(tzinfo=UTC)


def observed_time(s: str | None) -> datetime | None:
    """A time another component wrote (a pod's or a node's): None when absent or malformed."""
    try:
        return parse_time(s)
    except ValueError:
        return None


def parse(raw: dict[str, Any] | None) -> SFTJobStatus:
    """The stored status (`body.status`, None for a new job) as a model; fields the model
    does not know are left out (module docstring).

    Raises pydantic.ValidationError for a known field with an invalid value."""
    data = {k: v for k, v in (raw or {}).items() if k not in FOREIGN_KEYS}
    try:
        return SFTJobStatus.model_validate(data)
    except ValidationError as err:
        unknown = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
        if len(unknown) != len(err.errors()):
            raise
    data = copy.deepcopy(data)
    for loc in unknown:
        *parents, leaf = loc
        node: Any = data
        for key in parents:
            node = node[key]
        node.pop(leaf, None)
    return SFTJobStatus.model_validate(data)



_KNOWN = frozenset(f.alias or name for name, f in SFTJobStatus.model_fields.items())


def dump(status: SFTJobStatus) -> dict[str, Any]:
    """The wire form: camelCase, unset optional fields absent rather than null."""
    return status.model_dump(by_alias=True, exclude_none=True)


def merge_patch(old: dict[str, Any] | None, new: SFTJobStatus) -> dict[str, Any]:
    """The `status` of a JSON merge patch (RFC 7386) that stores `new` over `old`.

    A merge patch deletes only what it names with null, so every top-level field stored in
    `old` and unset in `new` (restartAfter after a resume, startTime on suspend) is sent as
    an explicit null. Nested objects (progress, output, restarts) are merged by the API
    server; the operator only ever adds or changes their fields. Conditions is a list and
    is replaced whole."""
    wire = dump(new)
    gone = {k: None for k in (old or {}) if k not in wire and k in _KNOWN}
    return {**gone, **wire}


def fields_patch(**fields: Any) -> dict[str, Any]:
    """A merge patch that sets only `fields` (model field names, validated like the model)."""
    return SFTJobStatus(**fields).model_dump(by_alias=True, include=set(fields))
