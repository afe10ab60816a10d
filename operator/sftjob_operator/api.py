"""The SFTJob API (`sftjob.io/v1alpha1`): the spec as typed pydantic models.

The CRD in crds/ is generated from these models (see crd.py), so the descriptions here
are what `kubectl explain sftjob.spec...` prints and the defaults here are what the API
server fills in. `spec.resources` is in resources.py, the status in status.py, and what
they all share in schema.py. The trainer-facing sections (`model`, `data`, `training`) are derived field by
field from the trainer's own config (`sftjob_contract.config`), renamed to camelCase, so
the two sides never disagree about a default, a bound or a description.

Cross-field checks and immutability are CEL rules (`x-kubernetes-validations`) attached
to the models here; the API server evaluates them, the operator never has to.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.alias_generators import to_camel
from sftjob_contract import command
from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, TrainerConfig
from sftjob_contract.tracking import HTTP_URI, MlflowConfig, TrackingConfig, WandbConfig
from sftjob_contract.sections import DataSource, batch_splits_cel

from .resources import ResourcesSpec
from .schema import DNS_SUBDOMAIN, IMMUTABLE, URI_MESSAGE, URI_RULE, SpecModel, cel, rules

GROUP = "sftjob.io"
VERSION = "v1alpha1"
KIND = "SFTJob"
PLURAL = "sftjobs"
SINGULAR = "sftjob"
SHORT_NAMES = ["sft"]


def _derive(source: type[BaseModel], *, include: list[str] | None = None, exclude: tuple[str, ...] = (),
            extra: dict[str, dict[str, Any]] | None = None) -> dict[str, tuple[Any, Any]]:
    """Field definitions copied from a trainer config model (same type, bounds, description).

    `extra` adds schema keywords (e.g. CEL rules) to chosen fields. default_factory values
    become plain defaults so that the CRD shows them and the API server applies them.
    """
    out = {}
    names = include if include is not None else list(source.model_fields)
    for name in names:
        if name in exclude:
            continue
        info = copy.copy(source.model_fields[name])
        info.description = _camel_text(info.description)
        if info.default_factory is not None:
            info.default = info.get_default(call_default_factory=True)
            info.default_factory = None
        if extra and name in extra:
            info.json_schema_extra = {**(info.json_schema_extra or {}), **extra[name]}  # type: ignore[dict-item]  # pydantic's JsonDict
        out[name] = (info.annotation, info)
    return out


_TRAINER_KEYS = {n for m in (ModelConfig, DataConfig, DataSource, OptimConfig, LoraConfig, TrainerConfig)
                 for n in m.model_fields}
_SNAKE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def _camel_text(text: str | None) -> str | None:
    """Rename trainer keys mentioned in a description to the spellings the CRD uses."""
    if not text:
        return text
    return _SNAKE.sub(lambda m: to_camel(m.group(0)) if m.group(0) in _TRAINER_KEYS else m.group(0), text)


_ModelBase = create_model(  # type: ignore[call-overload]  # fields built at import
    "_ModelBase", __base__=SpecModel,
    **_derive(ModelConfig, extra={"path": rules(cel(URI_RULE, URI_MESSAGE))}),
)


class ModelSpec(_ModelBase):  # type: ignore[misc,valid-type]  # a create_model base
    """The base model to fine-tune (the trainer's `model` section). Immutable once created."""


_uri_items = {"items": {"type": "string", "maxLength": 1024,
                         **rules(cel(URI_RULE, "every file " + URI_MESSAGE))}}
_SourceBase = create_model(  # type: ignore[call-overload]  # fields built at import
    "_SourceBase", __base__=SpecModel, **_derive(DataSource, extra={"files": _uri_items}),
)


class SourceSpec(_SourceBase):  # type: ignore[misc,valid-type]  # a create_model base
    """One weighted training source (the trainer's `data.sources[i]`)."""


def _data_fields() -> dict[str, tuple[Any, Any]]:
    """The trainer's data section, its sources as camelCase `SourceSpec`s."""
    fields = _derive(DataConfig, extra={"train_files": _uri_items, "val_files": _uri_items})
    _, info = fields["sources"]
    fields["sources"] = (list[SourceSpec] | None, info)
    return fields


_DataBase = create_model("_DataBase", __base__=SpecModel, **_data_fields())  # type: ignore[call-overload]  # fields built at import


class DataSpec(_DataBase):  # type: ignore[misc,valid-type]  # a create_model base
    """Training data, tokenization and batching (the trainer's `data` section). Immutable."""

    model_config = ConfigDict(json_schema_extra=rules(
        cel("has(self.messagesKey) || self.promptKey != self.responseKey",
             "data.responseKey must differ from data.promptKey (the response would be the prompt itself)",
             field_path=".responseKey"),
        # trainFiles is the one-source form of sources: exactly one of them.
        cel("has(self.trainFiles) || has(self.sources)",
            "set data.trainFiles (one source) or data.sources (weighted sources)",
            field_path=".trainFiles", reason="FieldValueRequired"),
        cel("!has(self.trainFiles) || !has(self.sources)",
            "data.trainFiles and data.sources are exclusive: give exactly one (trainFiles is the one-source form)",
            field_path=".sources", reason="FieldValueForbidden"),
    ))


_OptimBase = create_model("_OptimBase", __base__=SpecModel, **_derive(OptimConfig))  # type: ignore[call-overload]  # fields built at import


class OptimSpec(_OptimBase):  # type: ignore[misc,valid-type]  # a create_model base
    """AdamW and its learning-rate schedule (the trainer's `optim` section)."""


# merge_on_export is spec.output.mergeLora: where the model goes is the output's business.
_LoraBase = create_model(  # type: ignore[call-overload]  # fields built at import
    "_LoraBase", __base__=SpecModel, **_derive(LoraConfig, exclude=("merge_on_export",))
)


class LoraSpec(_LoraBase):  # type: ignore[misc,valid-type]  # a create_model base
    """LoRA adapters (the trainer's `lora` section); rank 0 means a full fine-tune."""


# The trainer's `trainer` section minus what the operator derives: output_dir (from
# spec.storage), save_freq, save_interval_s and keep_checkpoints (spec.checkpoint), metrics_port (the
# operator scrapes it), stop_timeout_s (spec.runPolicy.terminationGracePeriodSeconds) and export (spec.output.export).
# A key the trainer adds appears here by itself (and the CRD drift test asks for `make crds`).
OPERATOR_OWNED_TRAINER_FIELDS = ("output_dir", "save_freq", "save_interval_s", "keep_checkpoints", "metrics_port",
                                 "stop_timeout_s", "export")
TRAINING_RUN_FIELDS = [n for n in TrainerConfig.model_fields if n not in OPERATOR_OWNED_TRAINER_FIELDS]
_TrainingBase = create_model(  # type: ignore[call-overload]  # fields built at import
    "_TrainingBase", __base__=SpecModel,
    # Plain (frozen) defaults rather than factories: the CRD then says `default: {}`, so the
    # API server fills in the section and its defaults when a spec leaves it out.
    optim=(OptimSpec, Field(default=OptimSpec(), description="Optimizer and learning-rate schedule.")),
    lora=(LoraSpec, Field(default=LoraSpec(), description="LoRA adapters; rank 0 trains all weights.")),
    **_derive(TrainerConfig, include=TRAINING_RUN_FIELDS),
)


class TrainingSpec(_TrainingBase):  # type: ignore[misc,valid-type]  # a create_model base
    """How to train: run length, optimizer, LoRA, precision, seed. Immutable once created."""


class SecretRef(SpecModel):
    """A reference to a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                      description="Secret name.")


class ClaimRef(SpecModel):
    """A PersistentVolumeClaim in the job's namespace."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The claim's name.")


class StorageSpec(SpecModel):
    """Where the job writes checkpoints and the exported model, and how to reach object storage.

    Credentials are only ever read from a Secret (`credentialsSecretRef`): fields such as
    accessKey do not exist, so `kubectl apply` rejects them as unknown fields.

    A path `uri` must live on a volume that outlives the pods: `persistentVolumeClaim` is
    then required and is mounted at `uri` on every rank (ReadWriteMany for several nodes).
    Without it the checkpoints and the model would vanish with each container.
    """

    model_config = ConfigDict(json_schema_extra=rules(
        cel("self.uri.startsWith('s3://') || has(self.persistentVolumeClaim)",
             "a path storage.uri needs storage.persistentVolumeClaim (mounted at that path on every rank); "
             "without a volume the checkpoints and the model would vanish with the pods",
             field_path=".persistentVolumeClaim"),
        cel("!has(self.persistentVolumeClaim) || !self.uri.startsWith('s3://')",
             "storage.persistentVolumeClaim applies only to a path storage.uri, not s3://",
             field_path=".persistentVolumeClaim"),
        cel("self.uri.startsWith('s3://') || (self.uri.matches('^/[^/]') "
            f"&& !self.uri.startsWith('{command.CONFIG_DIR}') && !self.uri.startsWith('/dev/'))",
             f"a path storage.uri must be a directory below / (not /, /dev/... or {command.CONFIG_DIR}), "
             "where the claim is mounted", field_path=".uri"),
    ))

    uri: str = Field(
        min_length=1, max_length=1024,
        description="Root for this job's outputs: s3://bucket/prefix, or an absolute path on "
        "persistentVolumeClaim. The job writes under <uri>/<namespace>/<name>/<uid>/ (checkpoints/, "
        "hf/final/, metrics.jsonl).",
        json_schema_extra=rules(cel(URI_RULE, URI_MESSAGE)),
    )
    persistent_volume_claim: ClaimRef | None = Field(
        default=None,
        description="Volume for a path uri: the claim is mounted at uri on every rank, so checkpoints "
        "and the model survive the pods. Several nodes need a ReadWriteMany claim (NFS, CephFS, Lustre, ...).",
    )
    endpoint: str | None = Field(
        default=None, max_length=1024, pattern=r"^https?://[^/\s:?#@]+(:[0-9]{1,5})?(/[^\s]*)?$",
        description="S3 endpoint URL with a host, e.g. http://minio.storage:9000, for S3-compatible stores such as "
        "MinIO (sets AWS_ENDPOINT_URL); empty: AWS.",
    )
    region: str | None = Field(default=None, max_length=64, description="S3 region (sets AWS_REGION).")
    credentials_secret_ref: SecretRef | None = Field(
        default=None,
        description="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, injected into the "
        "pods with secretKeyRef. Empty: the pods use ambient credentials (e.g. a workload identity).",
    )


class CheckpointSpec(SpecModel):
    """Periodic checkpoints (the trainer also checkpoints on SIGTERM before a restart)."""

    interval: int = Field(
        default=TrainerConfig.model_fields["save_freq"].default, ge=0,
        description="Checkpoint every N optimizer steps (0: by intervalSeconds and on SIGTERM only).",
    )
    interval_seconds: float = Field(
        default=TrainerConfig.model_fields["save_interval_s"].default, ge=0,
        description="Also checkpoint at the first step boundary once this many seconds have passed since the last "
        "committed checkpoint (or the start), so that a crash, SIGKILL or lost node loses at most about this much "
        "training; the SIGTERM of a preemption always checkpoints. 0 disables.",
    )
    keep: int = Field(
        default=TrainerConfig.model_fields["keep_checkpoints"].default, ge=1, le=1000,
        description="Committed checkpoints to keep; older ones are pruned after a new one commits.",
    )


class OutputSpec(SpecModel):
    """The exported Hugging Face model (written to <storage>/hf/final, see status.output.uri)."""

    merge_lora: bool = Field(
        default=LoraConfig.model_fields["merge_on_export"].default,
        description="LoRA runs: export the merged full model to hf/final as well as the adapter to hf/adapter.",
    )
    export: Literal["last", "best"] = Field(
        default=TrainerConfig.model_fields["export"].default,
        description=_camel_text(TrainerConfig.model_fields["export"].description),
    )


_MLFLOW_URI = rules(cel(f"self.matches(r'{HTTP_URI}')", "tracking.mlflow.trackingUri must be an http:// or https:// "
                        "URL with a host, e.g. http://mlflow.mlflow:5000"))
MlflowSpec = create_model(  # type: ignore[call-overload]  # fields built at import
    "MlflowSpec", __base__=SpecModel, __doc__=MlflowConfig.__doc__,
    **_derive(MlflowConfig, extra={"tracking_uri": _MLFLOW_URI}))
WandbSpec = create_model(  # type: ignore[call-overload]  # fields built at import
    "WandbSpec", __base__=SpecModel, __doc__=WandbConfig.__doc__, **_derive(WandbConfig))


class TrackingSpec(SpecModel):
    """Experiment tracking (the trainer's `tracking` section): TensorBoard, MLflow, W&B. Immutable."""

    tensorboard: bool = Field(default=False, description=TrackingConfig.model_fields["tensorboard"].description)
    mlflow: MlflowSpec | None = Field(  # type: ignore[valid-type]  # made by create_model
        default=None, description=TrackingConfig.model_fields["mlflow"].description)
    wandb: WandbSpec | None = Field(  # type: ignore[valid-type]  # made by create_model
        default=None, description=TrackingConfig.model_fields["wandb"].description)


# runPolicy.cleanPodPolicy (Kubeflow's names): which pods go when the job finishes.
CleanPodPolicy = Literal["All", "Running", "None"]
CLEAN_RUNNING: CleanPodPolicy = "Running"


class RunPolicy(SpecModel):
    """Restarts, deadlines and clean-up."""

    backoff_limit: int = Field(
        default=3, ge=0, le=1000,
        description="Failed attempts (a rank exiting 1 or 3..127, OOM-killed, or a hang the progress watchdog "
        "caught) allowed before the job fails. Exit 2 (invalid config or data) fails the job at once.",
    )
    preemption_limit: int = Field(
        default=20, ge=0, le=10000,
        description="Gang restarts caused by preemption (eviction, node loss, SIGTERM/SIGKILL, pod "
        "deletion) allowed before the job fails; counted apart from backoffLimit.",
    )
    restart_backoff_seconds: int = Field(
        default=10, ge=0, le=3600,
        description="Wait before the first gang restart; doubles with each restart, at most 300 s.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job when it has been running longer than this."
    )
    startup_deadline_seconds: int = Field(
        default=600, ge=1,
        description="Fail the job when its pods are not all running this long after they were created "
        "(unschedulable, ImagePullBackOff, a missing Secret, ...); the job's conditions say what they wait for.",
    )
    progress_deadline_seconds: int | None = Field(
        default=1800, ge=60,
        description="Hang watchdog: once a gang attempt has made its first step, restart the gang (counted as a "
        "failure, reason ProgressDeadlineExceeded) when status.progress.step has not advanced for this long, "
        "e.g. a rank stuck in a collective. Not applied after the last step (final validation and export). "
        "Time the operator was not watching (down, or a new leader taking over) does not count: the clock "
        "runs from the later of the last step and the operator's start. Unset: no watchdog.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the SFTJob (and its pods) this long after it succeeded or failed."
    )
    clean_pod_policy: CleanPodPolicy = Field(
        default=CLEAN_RUNNING,
        description="Pods to delete when the job finishes: All, Running (keep finished pods for their "
        "logs), or None. Running pods of a failed job are always stopped.",
    )
    termination_grace_period_seconds: int = Field(
        default=120, ge=5, le=86400,
        description="Time from SIGTERM to SIGKILL for a training pod; the trainer checkpoints within it.",
    )


_VALIDATES = "(has(self.data.valFiles) && size(self.data.valFiles) > 0 && self.training.testFreq > 0)"


def _size_rules(nodes: str, name: str, when: str = "true") -> list[dict[str, Any]]:
    """CEL rules that a gang of `nodes` pods (a CEL expression) can train this job: the
    sequence-parallel size divides its world, and the global batch divides into equal
    micro-batches over its data-parallel ranks (world / sequenceParallelSize). Checked at the
    wanted size and at the elastic minimum (the sizes between are checked by the operator,
    which skips a size that does not divide)."""
    world = f"({nodes} * self.resources.processesPerNode)"
    sp = "self.training.sequenceParallelSize"
    return [
        cel(f"!({when}) || {world} % {sp} == 0",
            f"training.sequenceParallelSize must divide the world size at {name} ({name} * resources.processesPerNode)",
            field_path=".training.sequenceParallelSize"),
        cel(f"!({when}) || {world} % {sp} != 0 || "
            + batch_splits_cel("self.data.trainBatchSize", "self.data.microBatchSizePerGpu", f"{world} / {sp}"),
            "data.trainBatchSize must be a multiple of data.microBatchSizePerGpu times the data-parallel size at "
            f"{name} ({name} * resources.processesPerNode / training.sequenceParallelSize)",
            field_path=".data.trainBatchSize"),
    ]


class SFTJobSpec(SpecModel):
    """A supervised fine-tuning run: model + data + training config, run as a gang of pods."""

    model_config = ConfigDict(json_schema_extra=rules(
        *_size_rules("self.resources.nodes", "resources.nodes"),
        *_size_rules("(has(self.resources.minNodes) ? self.resources.minNodes : self.resources.nodes)",
                     "resources.minNodes", when="has(self.resources.minNodes)"),
        cel("!self.training.cpuOffload || self.resources.gpusPerNode > 0",
             "training.cpuOffload needs a GPU job (resources.gpusPerNode > 0): on a CPU job the states already live "
             "in host memory", field_path=".training.cpuOffload"),
        cel("self.training.fsdpGather != 'per_step' || !self.training.cpuOffload",
             "training.fsdpGather per_step keeps the whole model on each GPU for the step, which training.cpuOffload "
             "is there to avoid: use auto or per_layer with it", field_path=".training.fsdpGather"),
        cel(f"self.training.earlyStoppingPatience == 0 || {_VALIDATES}",
             "training.earlyStoppingPatience needs periodic validation: set data.valFiles and training.testFreq",
             field_path=".training.earlyStoppingPatience"),
        cel(f"self.output.export != 'best' || {_VALIDATES}",
             "output.export best needs periodic validation: set data.valFiles and training.testFreq",
             field_path=".output.export"),
        cel("!self.model.ligerKernel || self.resources.gpusPerNode > 0",
             "model.ligerKernel needs a GPU job (resources.gpusPerNode > 0): Liger's kernels are Triton GPU kernels",
             field_path=".model.ligerKernel"),
        cel("self.resources.processesPerNode == oldSelf.resources.processesPerNode",
             "resources.processesPerNode is immutable", field_path=".resources.processesPerNode"),
        cel("!has(self.storage.endpoint) || self.storage.uri.startsWith('s3://')",
             "storage.endpoint only applies to an s3:// storage.uri", field_path=".storage.endpoint"),
        cel("self.model.attnImplementation != 'flash_attention_2' || self.training.precision != 'fp32'",
             "model.attnImplementation flash_attention_2 needs training.precision bf16 (flash-attention does not run "
             "in fp32); use attnImplementation auto or sdpa, or precision bf16",
             field_path=".model.attnImplementation"),
    ))

    model: ModelSpec = Field(description="The base model to fine-tune. Immutable.",
                             json_schema_extra=rules(cel(IMMUTABLE, "model is immutable")))
    data: DataSpec = Field(description="Training data and batching. Immutable.",
                           json_schema_extra=rules(cel(IMMUTABLE, "data is immutable")))
    # Sections a minimal spec may leave out have plain (frozen) defaults, not factories: the
    # CRD then carries `default: {}`, and the API server fills in each section and its fields.
    training: TrainingSpec = Field(default=TrainingSpec(), description="Training hyper-parameters. Immutable.",
                                   json_schema_extra=rules(cel(IMMUTABLE, "training is immutable")))
    resources: ResourcesSpec = Field(default=ResourcesSpec(), description="Gang shape and placement.")
    storage: StorageSpec = Field(description="Where outputs go and how to reach object storage. Immutable.",
                                 json_schema_extra=rules(cel(IMMUTABLE, "storage is immutable")))
    checkpoint: CheckpointSpec = Field(default=CheckpointSpec(), description="Checkpoint interval and retention.")
    output: OutputSpec = Field(default=OutputSpec(), description="The exported model.")
    tracking: TrackingSpec = Field(default=TrackingSpec(), description="Experiment tracking. Immutable.",
                                   json_schema_extra=rules(cel(IMMUTABLE, "tracking is immutable")))
    run_policy: RunPolicy = Field(default=RunPolicy(), description="Restarts, deadlines and clean-up.")
    suspend: bool = Field(
        default=False,
        description="True stops the pods gracefully (they checkpoint first); false again resumes from the checkpoint.",
    )
