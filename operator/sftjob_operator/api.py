"""The SFTJob API (`sftjob.io/v1alpha1`): spec and status as typed pydantic models.

The CRD in crds/ is generated from these models (see crd.py), so the descriptions here are
what `kubectl explain sftjob.spec...` prints and the defaults here are what the API server
fills in. The trainer-facing sections (`model`, `data`, `training`) are derived field by
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
from sftjob_contract import env as E
from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, TrainerConfig

GROUP = "sftjob.io"
VERSION = "v1alpha1"
KIND = "SFTJob"
PLURAL = "sftjobs"
SINGULAR = "sftjob"
SHORT_NAMES = ["sft"]

# A URI the trainer can read or write: s3://BUCKET[/key] (a valid bucket name) or an absolute
# path in the pod.
_S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
_URI_RULE = f"self.startsWith('s3://') ? self.matches('{_S3_URI}') : self.startsWith('/')"
_URI_MESSAGE = "must be s3://BUCKET[/prefix] with a valid bucket name, or an absolute path"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Label keys (also taint and toleration keys) and label values, as core/v1 validates them.
_QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                   r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# An environment variable name the kubelet accepts (no '=', no leading digit).
_ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Environment the operator sets on every trainer pod (builders._env); a user's entry would
# silently break the rendezvous or the storage settings, so the API server refuses them.
RESERVED_ENV = E.RESERVED
RESERVED_ENV_PREFIX = E.RESERVED_PREFIX
# Names that carry credentials: these must come from a Secret (valueFrom.secretKeyRef).
_CREDENTIAL_NAME = r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?|SESSION_TOKEN)(_|$)"


def _cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict:
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


class _Spec(BaseModel):
    """Base of every API model: camelCase on the wire, unknown keys rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def _derive(source: type[BaseModel], *, include: list[str] | None = None, exclude: tuple[str, ...] = (),
            extra: dict[str, dict] | None = None) -> dict[str, tuple[Any, Any]]:
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
            info.default = info.default_factory()  # type: ignore[call-arg]
            info.default_factory = None
        if extra and name in extra:
            info.json_schema_extra = {**(info.json_schema_extra or {}), **extra[name]}  # type: ignore[dict-item]
        out[name] = (info.annotation, info)
    return out


def _rules(*rules: dict) -> dict:
    return {"x-kubernetes-validations": list(rules)}


_TRAINER_KEYS = {n for m in (ModelConfig, DataConfig, OptimConfig, LoraConfig, TrainerConfig) for n in m.model_fields}
_SNAKE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def _camel_text(text: str | None) -> str | None:
    """Rename trainer keys mentioned in a description to the spellings the CRD uses."""
    if not text:
        return text
    return _SNAKE.sub(lambda m: to_camel(m.group(0)) if m.group(0) in _TRAINER_KEYS else m.group(0), text)


_ModelBase = create_model(  # type: ignore[call-overload]
    "_ModelBase", __base__=_Spec,
    **_derive(ModelConfig, extra={"path": _rules(_cel(_URI_RULE, _URI_MESSAGE))}),
)


class ModelSpec(_ModelBase):  # type: ignore[misc,valid-type]
    """The base model to fine-tune (the trainer's `model` section). Immutable once created."""


_uri_items = {"items": {"type": "string", "maxLength": 1024,
                         **_rules(_cel(_URI_RULE, "every file " + _URI_MESSAGE))}}
_DataBase = create_model(  # type: ignore[call-overload]
    "_DataBase", __base__=_Spec,
    **_derive(DataConfig, extra={"train_files": _uri_items, "val_files": _uri_items}),
)


class DataSpec(_DataBase):  # type: ignore[misc,valid-type]
    """Training data, tokenization and batching (the trainer's `data` section). Immutable."""

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("has(self.messagesKey) || self.promptKey != self.responseKey",
             "data.responseKey must differ from data.promptKey (the response would be the prompt itself)",
             field_path=".responseKey"),
    ))


_OptimBase = create_model("_OptimBase", __base__=_Spec, **_derive(OptimConfig))  # type: ignore[call-overload]


class OptimSpec(_OptimBase):  # type: ignore[misc,valid-type]
    """AdamW and its learning-rate schedule (the trainer's `optim` section)."""


# merge_on_export is spec.output.mergeLora: where the model goes is the output's business.
_LoraBase = create_model(  # type: ignore[call-overload]
    "_LoraBase", __base__=_Spec, **_derive(LoraConfig, exclude=("merge_on_export",))
)


class LoraSpec(_LoraBase):  # type: ignore[misc,valid-type]
    """LoRA adapters (the trainer's `lora` section); rank 0 means a full fine-tune."""


# The trainer's `trainer` section minus what the operator derives: output_dir (from
# spec.storage), save_freq, save_interval_s and keep_checkpoints (spec.checkpoint), metrics_port (the
# operator scrapes it) and stop_timeout_s (spec.runPolicy.terminationGracePeriodSeconds).
# A key the trainer adds appears here by itself (and the CRD drift test asks for `make crds`).
OPERATOR_OWNED_TRAINER_FIELDS = ("output_dir", "save_freq", "save_interval_s", "keep_checkpoints", "metrics_port",
                                 "stop_timeout_s")
TRAINING_RUN_FIELDS = [n for n in TrainerConfig.model_fields if n not in OPERATOR_OWNED_TRAINER_FIELDS]
_TrainingBase = create_model(  # type: ignore[call-overload]
    "_TrainingBase", __base__=_Spec,
    # Plain (frozen) defaults rather than factories: the CRD then says `default: {}`, so the
    # API server fills in the section and its defaults when a spec leaves it out.
    optim=(OptimSpec, Field(default=OptimSpec(), description="Optimizer and learning-rate schedule.")),
    lora=(LoraSpec, Field(default=LoraSpec(), description="LoRA adapters; rank 0 trains all weights.")),
    **_derive(TrainerConfig, include=TRAINING_RUN_FIELDS),
)


class TrainingSpec(_TrainingBase):  # type: ignore[misc,valid-type]
    """How to train: run length, optimizer, LoRA, precision, seed. Immutable once created."""


class Toleration(_Spec):
    """A pod toleration, as in core/v1 Toleration."""

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("self.operator == 'Exists' || (has(self.key) && self.key != '')",
             "a toleration without a key must use operator Exists (it then tolerates every taint)",
             field_path=".operator"),
        _cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "a toleration with operator Exists must not set a value", field_path=".value"),
        _cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds applies only to effect NoExecute", field_path=".tolerationSeconds"),
    ))

    key: str | None = Field(default=None, max_length=316, pattern=_QUALIFIED_NAME,
                            description="Taint key the toleration applies to (empty: all keys).")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, pattern=_LABEL_VALUE,
                              description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match (empty: all effects)."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class KeyRef(_Spec):
    """One key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="Object name.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in its data.")
    optional: bool | None = Field(default=None, description="Start the pod even when the object or key is missing.")


class EnvVarSource(_Spec):
    """Where a variable's value comes from: exactly one of secretKeyRef or configMapKeyRef."""

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("has(self.secretKeyRef) != has(self.configMapKeyRef)",
             "set exactly one of secretKeyRef or configMapKeyRef"),
    ))

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret (for credentials).")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


class EnvVar(_Spec):
    """An environment variable for the trainer container.

    Names the operator sets itself (the rendezvous, storage and SFTJOB_* variables) are
    refused, and so is a credential-like name (..._TOKEN, ..._SECRET..., ..._API_KEY,
    ..._PASSWORD, ...) with a plain value: such a value belongs in a Secret, referenced
    with valueFrom.secretKeyRef, so that it never sits in the SFTJob, its ConfigMap or logs.
    """

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both",
             field_path=".valueFrom"),
        _cel(f"has(self.valueFrom) || !self.name.upperAscii().matches('{_CREDENTIAL_NAME}')",
             "looks like a credential: put it in a Secret and set valueFrom.secretKeyRef instead of a plain value",
             field_path=".value"),
    ))

    name: str = Field(
        description="Variable name (not one the operator sets: " + ", ".join(RESERVED_ENV)
        + f", {RESERVED_ENV_PREFIX}*).",
        min_length=1, max_length=253, pattern=_ENV_NAME,
        json_schema_extra=_rules(_cel(
            "!(self in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + f"]) && !self.startsWith('{RESERVED_ENV_PREFIX}')",
            "is set by the operator for every trainer pod and cannot be overridden")),
    )
    value: str | None = Field(default=None, description="Variable value (never a credential).", max_length=4096)
    value_from: EnvVarSource | None = Field(default=None, description="Take the value from a Secret or ConfigMap key.")


class ResourcesSpec(_Spec):
    """Shape and placement of the gang: nodes, processes, devices, image and scheduling."""

    nodes: int = Field(default=1, ge=1, le=1024, description="Training pods (one per node rank). Immutable.")
    processes_per_node: int = Field(
        default=1, ge=1, le=64,
        description="Trainer processes per pod (torchrun --nproc-per-node), usually the GPUs per pod. Immutable.",
    )
    gpus_per_node: int = Field(default=0, ge=0, le=64, description="nvidia.com/gpu limit per pod (0: CPU training).")
    cpu: int | str | None = Field(
        default=None, description="CPU request per pod (a Kubernetes quantity, e.g. 8 or 500m).",
        json_schema_extra={"maxLength": 64, **_rules(_cel(
            "type(self) == string ? isQuantity(self) && quantity(self).isGreaterThan(quantity('0')) : self > 0",
            "must be a positive Kubernetes quantity, e.g. 8 or 500m"))},
    )
    memory: str | None = Field(
        default=None, max_length=64, description="Memory request and limit per pod (a quantity, e.g. 64Gi).",
        json_schema_extra=_rules(_cel("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                                      "must be a positive Kubernetes quantity, e.g. 64Gi or 512Mi")),
    )
    image: str = Field(
        default="ghcr.io/sftjob/trainer:0.1.0", min_length=1, max_length=1024, pattern=r"^[^\s]+$",
        description="Trainer container image.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the trainer container."
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="Node labels the pods must match.",
        json_schema_extra={"maxProperties": 64, "additionalProperties": {"type": "string", "maxLength": 63}, **_rules(
            _cel(f"self.all(k, k.size() <= 316 && k.matches(r'{_QUALIFIED_NAME}'))",
                 "every key must be a valid label key ([prefix/]name, name of at most 63 alphanumerics, '-', '_', '.')"),
            _cel(f"self.all(k, self[k].matches(r'{_LABEL_VALUE}'))",
                 "every value must be a valid label value (at most 63 alphanumerics, '-', '_', '.')"))},
    )
    tolerations: list[Toleration] | None = Field(default=None, description="Tolerations of the pods.", max_length=64)
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=_DNS_SUBDOMAIN,
                                            description="PriorityClass of the pods.")
    scheduler_name: str | None = Field(
        default=None, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="Scheduler of the pods (e.g. a gang scheduler); empty: the default scheduler.",
    )
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=_DNS_SUBDOMAIN,
        description="ServiceAccount the pods run as (e.g. one bound to a cloud storage role).",
    )
    env: list[EnvVar] | None = Field(
        default=None, max_length=64,
        description="Extra environment variables for the trainer, unique by name. Storage credentials "
        "belong in storage.credentialsSecretRef; other credentials in valueFrom.secretKeyRef.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class SecretRef(_Spec):
    """A reference to a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN,
                      description="Secret name.")


class ClaimRef(_Spec):
    """A PersistentVolumeClaim in the job's namespace."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="The claim's name.")


class StorageSpec(_Spec):
    """Where the job writes checkpoints and the exported model, and how to reach object storage.

    Credentials are only ever read from a Secret (`credentialsSecretRef`): fields such as
    accessKey do not exist, so `kubectl apply` rejects them as unknown fields.

    A path `uri` must live on a volume that outlives the pods: `persistentVolumeClaim` is
    then required and is mounted at `uri` on every rank (ReadWriteMany for several nodes).
    Without it the checkpoints and the model would vanish with each container.
    """

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("self.uri.startsWith('s3://') || has(self.persistentVolumeClaim)",
             "a path storage.uri needs storage.persistentVolumeClaim (mounted at that path on every rank); "
             "without a volume the checkpoints and the model would vanish with the pods",
             field_path=".persistentVolumeClaim"),
        _cel("!has(self.persistentVolumeClaim) || !self.uri.startsWith('s3://')",
             "storage.persistentVolumeClaim applies only to a path storage.uri, not s3://",
             field_path=".persistentVolumeClaim"),
        _cel("self.uri.startsWith('s3://') || (self.uri.matches('^/[^/]') && !self.uri.startsWith('/etc/sftjob')"
             " && !self.uri.startsWith('/dev/'))",
             "a path storage.uri must be a directory below / (not /, /dev/... or /etc/sftjob), where the claim "
             "is mounted", field_path=".uri"),
    ))

    uri: str = Field(
        min_length=1, max_length=1024,
        description="Root for this job's outputs: s3://bucket/prefix, or an absolute path on "
        "persistentVolumeClaim. The job writes under <uri>/<namespace>/<name>/<uid>/ (checkpoints/, "
        "hf/final/, metrics.jsonl).",
        json_schema_extra=_rules(_cel(_URI_RULE, _URI_MESSAGE)),
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


class CheckpointSpec(_Spec):
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


class OutputSpec(_Spec):
    """The exported Hugging Face model (written to <storage>/hf/final, see status.output.uri)."""

    merge_lora: bool = Field(
        default=LoraConfig.model_fields["merge_on_export"].default,
        description="LoRA runs: export the merged full model to hf/final as well as the adapter to hf/adapter.",
    )


class RunPolicy(_Spec):
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
        "Unset: no watchdog.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the SFTJob (and its pods) this long after it succeeded or failed."
    )
    clean_pod_policy: Literal["All", "Running", "None"] = Field(
        default="Running",
        description="Pods to delete when the job finishes: All, Running (keep finished pods for their "
        "logs), or None. Running pods of a failed job are always stopped.",
    )
    termination_grace_period_seconds: int = Field(
        default=120, ge=5, le=86400,
        description="Time from SIGTERM to SIGKILL for a training pod; the trainer checkpoints within it.",
    )


_IMMUTABLE = "self == oldSelf"


class SFTJobSpec(_Spec):
    """A supervised fine-tuning run: model + data + training config, run as a gang of pods."""

    model_config = ConfigDict(json_schema_extra=_rules(
        _cel("self.resources.nodes * self.resources.processesPerNode * self.data.microBatchSizePerGpu <= 0"
             " || self.data.trainBatchSize % (self.resources.nodes * self.resources.processesPerNode"
             " * self.data.microBatchSizePerGpu) == 0",
             "data.trainBatchSize must be a multiple of data.microBatchSizePerGpu times the world size "
             "(resources.nodes * resources.processesPerNode)",
             field_path=".data.trainBatchSize"),
        _cel("self.resources.nodes == oldSelf.resources.nodes", "resources.nodes is immutable",
             field_path=".resources.nodes"),
        _cel("self.resources.processesPerNode == oldSelf.resources.processesPerNode",
             "resources.processesPerNode is immutable", field_path=".resources.processesPerNode"),
        _cel("!has(self.storage.endpoint) || self.storage.uri.startsWith('s3://')",
             "storage.endpoint only applies to an s3:// storage.uri", field_path=".storage.endpoint"),
        _cel("self.model.attnImplementation != 'flash_attention_2' || self.training.precision != 'fp32'",
             "model.attnImplementation flash_attention_2 needs training.precision bf16 (flash-attention does not run "
             "in fp32); use attnImplementation auto or sdpa, or precision bf16", field_path=".model.attnImplementation"),
    ))

    model: ModelSpec = Field(description="The base model to fine-tune. Immutable.",
                             json_schema_extra=_rules(_cel(_IMMUTABLE, "model is immutable")))
    data: DataSpec = Field(description="Training data and batching. Immutable.",
                           json_schema_extra=_rules(_cel(_IMMUTABLE, "data is immutable")))
    # Sections a minimal spec may leave out have plain (frozen) defaults, not factories: the
    # CRD then carries `default: {}`, and the API server fills in each section and its fields.
    training: TrainingSpec = Field(default=TrainingSpec(), description="Training hyper-parameters. Immutable.",
                                   json_schema_extra=_rules(_cel(_IMMUTABLE, "training is immutable")))
    resources: ResourcesSpec = Field(default=ResourcesSpec(), description="Gang shape and placement.")
    storage: StorageSpec = Field(description="Where outputs go and how to reach object storage. Immutable.",
                                 json_schema_extra=_rules(_cel(_IMMUTABLE, "storage is immutable")))
    checkpoint: CheckpointSpec = Field(default=CheckpointSpec(), description="Checkpoint interval and retention.")
    output: OutputSpec = Field(default=OutputSpec(), description="The exported model.")
    run_policy: RunPolicy = Field(default=RunPolicy(), description="Restarts, deadlines and clean-up.")
    suspend: bool = Field(
        default=False,
        description="True stops the pods gracefully (they checkpoint first); false again resumes from the checkpoint.",
    )


# ---------------------------------------------------------------------------------------
# Status. The operator is its only writer; it is also where the operator keeps everything
# it must not lose when it restarts (attempt numbers, restart times), so no state lives in
# the operator's memory. The CRD keeps unknown status fields (kopf writes there too).

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]


class Condition(_Spec):
    """A condition in Kubernetes form (metav1.Condition)."""

    type: str = Field(description="Ready, Running, Restarting, Suspended, Succeeded, Failed, Reconciling or Stalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason, one of the constants in sftjob_operator.conditions.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(default=None, description="metadata.generation this was computed from.")


class RestartCounts(_Spec):
    """Gang restarts, by cause."""

    failures: int = Field(default=0, description="Restarts after a rank failed (exit 1 or 3..127, OOM-killed, "
                          "hung); spends runPolicy.backoffLimit.")
    preemptions: int = Field(default=0, description="Restarts after a pod was preempted, evicted, deleted or lost its node.")
    total: int = Field(default=0, description="failures + preemptions.")


class Progress(_Spec):
    """Training progress mirrored from the rank-0 trainer's metrics endpoint."""

    step: int | None = Field(default=None, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps in the whole run.")
    epoch: int | None = Field(default=None, description="Current epoch (0-based).")
    loss: float | None = Field(default=None, description="Latest training loss.")
    tokens_per_second: float | None = Field(default=None, description="Latest training throughput (all ranks).")
    last_checkpoint_step: int | None = Field(default=None, description="Step of the newest committed checkpoint.")
    summary: str | None = Field(default=None, description="step/totalSteps, as shown by kubectl get.")
    last_step_time: str | None = Field(default=None, description="When step last advanced (RFC 3339).")
    updated_time: str | None = Field(default=None, description="When these values were last read (RFC 3339).")


class OutputStatus(_Spec):
    """Where the results are."""

    uri: str | None = Field(default=None, description="The exported Hugging Face model (set when the job succeeds).")
    checkpoints_uri: str | None = Field(default=None, description="Where the job's checkpoints are written.")


class SFTJobStatus(_Spec):
    """Observed state of an SFTJob."""

    phase: Phase | None = Field(default=None, description="Pending, Running, Restarting, Suspended, Succeeded or Failed.")
    observed_generation: int | None = Field(default=None, description="The metadata.generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="Current conditions.")
    restarts: RestartCounts = Field(default_factory=RestartCounts, description="Gang restarts by cause.")
    progress: Progress = Field(default_factory=Progress, description="Training progress.")
    start_time: str | None = Field(default=None, description="When all pods of the job first ran (reset on suspend).")
    completion_time: str | None = Field(default=None, description="When the job succeeded or failed.")
    output: OutputStatus = Field(default_factory=OutputStatus, description="Where the results are.")
    attempt: int = Field(
        default=0,
        description="Gang generation: grows whenever the pods are torn down (restart or suspend). Pods "
        "carry it in the sftjob.io/attempt label so that stale pods are never taken for the current gang.",
    )
    launched_attempt: int | None = Field(default=None, description="The attempt whose pods were all created.")
    launch_time: str | None = Field(default=None, description="When the current attempt's pods were created.")
    restart_after: str | None = Field(default=None, description="Earliest time of the next gang start (back-off).")
    message: str | None = Field(default=None, description="Why the job is in its phase.")
