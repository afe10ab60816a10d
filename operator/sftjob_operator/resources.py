"""`spec.resources`: the shape, placement and environment of the gang's pods.

Part of the SFTJob spec (api.py), kept apart because it is the one section that speaks
core/v1 (tolerations, Secret and ConfigMap references, environment variables) and so
carries most of the CRD's pattern and CEL checks.
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from sftjob_contract import env as E

from .schema import CREDENTIAL_NAME, DNS_SUBDOMAIN, ENV_NAME, LABEL_VALUE, QUALIFIED_NAME, SpecModel, cel, rules

# Environment the operator sets on every trainer pod (builders._env); a user's entry would
# silently break the rendezvous or the storage settings, so the API server refuses them.
RESERVED_ENV = E.RESERVED
RESERVED_ENV_PREFIX = E.RESERVED_PREFIX


class Toleration(SpecModel):
    """A pod toleration, as in core/v1 Toleration."""

    model_config = ConfigDict(json_schema_extra=rules(
        cel("self.operator == 'Exists' || (has(self.key) && self.key != '')",
             "a toleration without a key must use operator Exists (it then tolerates every taint)",
             field_path=".operator"),
        cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "a toleration with operator Exists must not set a value", field_path=".value"),
        cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds applies only to effect NoExecute", field_path=".tolerationSeconds"),
    ))

    key: str | None = Field(default=None, max_length=316, pattern=QUALIFIED_NAME,
                            description="Taint key the toleration applies to (empty: all keys).")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, pattern=LABEL_VALUE,
                              description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match (empty: all effects)."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class KeyRef(SpecModel):
    """One key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="Object name.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in its data.")
    optional: bool | None = Field(default=None, description="Start the pod even when the object or key is missing.")


class EnvVarSource(SpecModel):
    """Where a variable's value comes from: exactly one of secretKeyRef or configMapKeyRef."""

    model_config = ConfigDict(json_schema_extra=rules(
        cel("has(self.secretKeyRef) != has(self.configMapKeyRef)",
             "set exactly one of secretKeyRef or configMapKeyRef"),
    ))

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret (for credentials).")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


class EnvVar(SpecModel):
    """An environment variable for the trainer container.

    Names the operator sets itself (the rendezvous, storage and SFTJOB_* variables) are
    refused, and so is a credential-like name (..._TOKEN, ..._SECRET..., ..._API_KEY,
    ..._PASSWORD, ...) with a plain value: such a value belongs in a Secret, referenced
    with valueFrom.secretKeyRef, so that it never sits in the SFTJob, its ConfigMap or logs.
    """

    model_config = ConfigDict(json_schema_extra=rules(
        cel("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both",
             field_path=".valueFrom"),
        cel(f"has(self.valueFrom) || !self.name.upperAscii().matches('{CREDENTIAL_NAME}')",
             "looks like a credential: put it in a Secret and set valueFrom.secretKeyRef instead of a plain value",
             field_path=".value"),
    ))

    name: str = Field(
        description="Variable name (not one the operator sets: " + ", ".join(RESERVED_ENV)
        + f", {RESERVED_ENV_PREFIX}*).",
        min_length=1, max_length=253, pattern=ENV_NAME,
        json_schema_extra=rules(cel(
            "!(self in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV)
            + f"]) && !self.startsWith('{RESERVED_ENV_PREFIX}')",
            "is set by the operator for every trainer pod and cannot be overridden")),
    )
    value: str | None = Field(default=None, description="Variable value (never a credential).", max_length=4096)
    value_from: EnvVarSource | None = Field(default=None, description="Take the value from a Secret or ConfigMap key.")


class ScratchSpec(SpecModel):
    """The node-local disk a training pod writes to: checkpoint shards staged before upload,
    and the downloaded model. A declared volume, never the container's writable layer."""

    model_config = ConfigDict(json_schema_extra=rules(
        cel("!has(self.storageClassName) || has(self.size)",
            "resources.scratch.storageClassName needs resources.scratch.size (the volume's capacity)",
            field_path=".storageClassName")))

    size: str | None = Field(
        default=None, max_length=64,
        description="Scratch space per pod (a quantity, e.g. 200Gi): the emptyDir's sizeLimit and the pod's "
        "ephemeral-storage request, so the scheduler places the pod only where the disk fits. It must hold the "
        "model (once per pod) and one checkpoint's shards of the pod's ranks (docs/install.md, scratch disk). "
        "Empty: no limit and no request.",
        json_schema_extra=rules(cel("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                                    "must be a positive Kubernetes quantity, e.g. 200Gi")),
    )
    storage_class_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Instead of an emptyDir, a generic ephemeral volume of this StorageClass and `size` per pod "
        "(e.g. local NVMe through a local-volume provisioner); it lives and dies with the pod.",
    )


class ResourcesSpec(SpecModel):
    """Shape and placement of the gang: nodes, processes, devices, image and scheduling."""

    # Each process of a GPU pod drives its own device (LOCAL_RANK): more processes than GPUs
    # would ask for a device that does not exist, after the whole gang has been scheduled.
    model_config = ConfigDict(json_schema_extra=rules(
        # has(): the API server also checks the rule against the section's default, {}.
        cel("!has(self.gpusPerNode) || self.gpusPerNode == 0 || !has(self.processesPerNode) || "
            "self.processesPerNode <= self.gpusPerNode",
            "resources.processesPerNode must not exceed resources.gpusPerNode on a GPU job (one device per process)",
            field_path=".processesPerNode"),
        cel("!has(self.minNodes) || self.minNodes <= (has(self.nodes) ? self.nodes : 1)",
            "resources.minNodes must not exceed resources.nodes", field_path=".minNodes")))

    nodes: int = Field(
        default=1, ge=1, le=1024,
        description="Training pods (one per node rank): the size the job wants. An edit resizes a running job at a "
        "checkpoint (it checkpoints, stops and resumes at the new size); the global batch stays the same.",
    )
    min_nodes: int | None = Field(
        default=None, ge=1, le=1024,
        description="Elastic jobs: the fewest pods the job may run at. When a gang must restart and only k < nodes "
        "pods can run (lost nodes, no quota), the job resumes at the largest size k >= minNodes instead of waiting, "
        "and grows back at a checkpoint when capacity returns. Unset: nodes (a fixed-size job).",
    )
    resize_cooldown_seconds: int = Field(
        default=300, ge=0, le=86400,
        description="Elastic jobs: the least time between a gang's start and a resize that grows it, so that the "
        "job does not thrash between sizes (each resize costs a checkpoint and a restart). Shrinking for lost "
        "capacity and a user's edit of nodes are not delayed.",
    )
    processes_per_node: int = Field(
        default=1, ge=1, le=64,
        description="Trainer processes per pod (torchrun --nproc-per-node), usually the GPUs per pod. Immutable.",
    )
    gpus_per_node: int = Field(default=0, ge=0, le=64, description="nvidia.com/gpu limit per pod (0: CPU training).")
    cpu: int | str | None = Field(
        default=None, description="CPU request per pod (a Kubernetes quantity, e.g. 8 or 500m).",
        json_schema_extra={"maxLength": 64, **rules(cel(
            "type(self) == string ? isQuantity(self) && quantity(self).isGreaterThan(quantity('0')) : self > 0",
            "must be a positive Kubernetes quantity, e.g. 8 or 500m"))},
    )
    memory: str | None = Field(
        default=None, max_length=64, description="Memory request and limit per pod (a quantity, e.g. 64Gi).",
        json_schema_extra=rules(cel("isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
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
        json_schema_extra={"maxProperties": 64, "additionalProperties": {"type": "string", "maxLength": 63}, **rules(
            cel(f"self.all(k, k.size() <= 316 && k.matches(r'{QUALIFIED_NAME}'))",
                 "every key must be a valid label key "
                 "([prefix/]name, name of at most 63 alphanumerics, '-', '_', '.')"),
            cel(f"self.all(k, self[k].matches(r'{LABEL_VALUE}'))",
                 "every value must be a valid label value (at most 63 alphanumerics, '-', '_', '.')"))},
    )
    tolerations: list[Toleration] | None = Field(default=None, description="Tolerations of the pods.", max_length=64)
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN,
                                            description="PriorityClass of the pods.")
    scheduler_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Scheduler of the pods (e.g. a gang scheduler); empty: the default scheduler.",
    )
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="ServiceAccount the pods run as (e.g. one bound to a cloud storage role).",
    )
    scratch: ScratchSpec = Field(default=ScratchSpec(), description="Node-local scratch disk of each pod.")
    env: list[EnvVar] | None = Field(
        default=None, max_length=64,
        description="Extra environment variables for the trainer, unique by name. Storage credentials "
        "belong in storage.credentialsSecretRef; other credentials in valueFrom.secretKeyRef.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
