"""Desired state: pure functions from an SFTJob to the manifests of its children.

Nothing here talks to the API server; every function is deterministic in its inputs so
that the tests compare whole manifests and the reconciler can create children by name,
only when absent. Children: a headless Service (stable DNS names for the rendezvous), a
ConfigMap with the trainer's config, and one pod per node rank.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError
from sftjob_contract import command, layout
from sftjob_contract import env as E
from sftjob_contract.config import SFTConfig

from . import api, sizes, tracking_env
from .resources import EnvVar

LABEL_JOB = "sftjob.io/job-name"
LABEL_RANK = "sftjob.io/rank"
LABEL_ATTEMPT = "sftjob.io/attempt"
MANAGED_BY = {"app.kubernetes.io/managed-by": "sftjob-operator", "app.kubernetes.io/name": "sftjob"}
# The scratch volume (spec.resources.scratch): checkpoint staging and the model cache.
SCRATCH_DIR = "/var/lib/sftjob"
CONTAINER = "trainer"
MASTER_PORT = 29500
METRICS_PORT = 9400


class InvalidSpec(ValueError):
    """The spec passed the API server's schema but cannot be turned into a runnable job."""


def pod_attempt(pod: dict[str, Any]) -> int:
    """The gang attempt a pod was built for, from its label (-1: not one of ours)."""
    try:
        return int(pod["metadata"].get("labels", {}).get(LABEL_ATTEMPT, "-1"))
    except ValueError:
        return -1


def pod_rank(pod: dict[str, Any]) -> int:
    """The node rank a pod of ours runs, from its label."""
    return int(pod["metadata"]["labels"][LABEL_RANK])


@dataclass(frozen=True)
class JobRef:
    """The identity of an SFTJob that its children need (names, owner reference)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def parse_spec(raw: dict[str, Any]) -> api.SFTJobSpec:
    """Validate a spec dict as stored by the API server (defaults already applied)."""
    try:
        return api.SFTJobSpec.model_validate(raw)
    except ValidationError as err:
        raise InvalidSpec(_short_errors(err)) from None


def _short_errors(err: ValidationError) -> str:
    return "; ".join(
        f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
    )


def service_name(job: JobRef) -> str:
    return job.name


def config_map_name(job: JobRef) -> str:
    return f"{job.name}-config"


def network_policy_name(job: JobRef) -> str:
    return f"{job.name}-ranks"


def pod_name(job: JobRef, rank: int) -> str:
    return f"{job.name}-node-{rank}"


def output_dir(job: JobRef, spec: api.SFTJobSpec) -> str:
    """Where this job's checkpoints and exports go. The uid keeps a re-created job with the
    same name from resuming an older run's checkpoints."""
    return f"{spec.storage.uri.rstrip('/')}/{job.namespace}/{job.name}/{job.uid}"


def model_uri(job: JobRef, spec: api.SFTJobSpec) -> str:
    """The exported Hugging Face model (docs/trainer-contract.md): hf/final, or for a LoRA run
    exported without merging (output.mergeLora false) the adapter in hf/adapter."""
    return f"{output_dir(job, spec)}/{layout.exported_model(spec.training.lora.rank > 0, spec.output.merge_lora)}"


def master_addr(job: JobRef) -> str:
    """Rank 0's name under the headless Service, without the cluster's DNS domain: the pod's
    resolv.conf search list ends with that domain (cluster.local or any other), so the
    name resolves on every cluster, where a hard-coded `.svc.cluster.local` did not."""
    return f"{pod_name(job, 0)}.{service_name(job)}.{job.namespace}.svc"


def stop_timeout_s(spec: api.SFTJobSpec) -> float:
    """The trainer's SIGTERM-to-exit budget: most of the grace period, leaving room for exit."""
    return round(spec.run_policy.termination_grace_period_seconds * 0.75, 1)


def elastic_shutdown_timeout(spec: api.SFTJobSpec) -> int:
    """torchrun escalates SIGTERM to SIGKILL for its workers after this many seconds; it
    must outlast the trainer's own stop budget and end before the kubelet's SIGKILL."""
    return max(1, int(spec.run_policy.termination_grace_period_seconds * 0.9))


def trainer_config(job: JobRef, spec: api.SFTJobSpec, metrics_port: int = METRICS_PORT) -> dict[str, Any]:
    """The trainer's SFTConfig as a plain dict, validated by the trainer's own model."""
    problem = sizes.misfit(spec, spec.resources.nodes)
    if problem:   # the CRD's CEL rules say the same at admission; this catches objects stored before them
        raise InvalidSpec(problem)
    training = spec.training.model_dump(exclude_none=True)
    optim = training.pop("optim")
    lora = {**training.pop("lora"), "merge_on_export": spec.output.merge_lora}
    raw = {
        "model": spec.model.model_dump(exclude_none=True),
        "data": spec.data.model_dump(exclude_none=True),
        "optim": {**optim, "betas": list(optim["betas"])},
        "lora": lora,
        "trainer": {
            **training,
            "output_dir": output_dir(job, spec),
            "save_freq": spec.checkpoint.interval,
            "save_interval_s": spec.checkpoint.interval_seconds,
            "keep_checkpoints": spec.checkpoint.keep,
            "metrics_port": metrics_port,
            "stop_timeout_s": stop_timeout_s(spec),
            "export": spec.output.export,
        },
        **tracking_env.trainer_section(spec, job.namespace, job.name),
    }
    try:
        SFTConfig.model_validate(raw)
    except ValidationError as err:
        raise InvalidSpec("the trainer rejects the derived config: " + _short_errors(err)) from None
    return raw


def labels(job: JobRef, **extra: str) -> dict[str, str]:
    return {**MANAGED_BY, LABEL_JOB: job.name, **extra}


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: JobRef, name: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job, **extra_labels),
        "ownerReferences": [owner_reference(job)],
    }


def build_service(job: JobRef, master_port: int = MASTER_PORT) -> dict[str, Any]:
    """Headless Service: gives each pod <hostname>.<service>.<ns>.svc DNS before it is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, service_name(job)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name},
            "ports": [{"name": "rendezvous", "port": master_port, "targetPort": master_port}],
        },
    }


def config_text(job: JobRef, spec: api.SFTJobSpec, metrics_port: int = METRICS_PORT) -> str:
    return yaml.safe_dump(trainer_config(job, spec, metrics_port), sort_keys=False)


def build_network_policy(job: JobRef, metrics_from: list[dict[str, Any]]) -> dict[str, Any]:
    """Ingress to the job's pods: anything from the job's own pods (the rendezvous port, an
    unauthenticated TCPStore whose collectives unpickle objects, and the ports the process
    group opens between ranks), and the metrics port from `metrics_from` only (the operator,
    the monitoring namespace). Nothing else reaches a training pod."""
    own = {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if metrics_from:
        ingress.append({"from": metrics_from, "ports": [{"port": METRICS_PORT, "protocol": "TCP"}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, network_policy_name(job)),
        "spec": {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }


def build_config_map(job: JobRef, spec: api.SFTJobSpec, metrics_port: int = METRICS_PORT) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job)),
        "data": {command.CONFIG_FILE: config_text(job, spec, metrics_port)},
    }


def trainer_command(job: JobRef, spec: api.SFTJobSpec, rank: int, master_port: int = MASTER_PORT) -> list[str]:
    """The trainer's launcher (torchrun with exit codes the failure policy can read) for a
    multi-process gang; plain `python -m sftjob_trainer` for a single process."""
    res = spec.resources
    config = [command.CONFIG_FLAG, f"{command.CONFIG_DIR}/{command.CONFIG_FILE}"]
    if res.nodes * res.processes_per_node == 1:
        return ["python", "-m", command.TRAINER_MODULE, *config]
    return [
        "python", "-m", command.LAUNCHER_MODULE,
        f"--nnodes={res.nodes}",
        f"--nproc-per-node={res.processes_per_node}",
        f"--node-rank={rank}",
        f"--master-addr={master_addr(job)}",
        f"--master-port={master_port}",
        command.SEPARATOR, *config,
    ]


def _env(job: JobRef, spec: api.SFTJobSpec, rank: int, attempt: int, master_port: int) -> list[dict[str, Any]]:
    res, storage = spec.resources, spec.storage
    env: list[dict[str, Any]] = [
        # PyTorchJob-style variables: WORLD_SIZE and RANK count pods (node ranks); torchrun
        # sets the per-process WORLD_SIZE/RANK/LOCAL_RANK for the trainer itself.
        {"name": E.MASTER_ADDR, "value": master_addr(job)},
        {"name": E.MASTER_PORT, "value": str(master_port)},
        {"name": E.WORLD_SIZE, "value": str(res.nodes)},
        {"name": E.RANK, "value": str(rank)},
        {"name": E.NODE_RANK, "value": str(rank)},
        {"name": E.NPROC_PER_NODE, "value": str(res.processes_per_node)},
        {"name": E.TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "value": str(elastic_shutdown_timeout(spec))},
        {"name": E.PYTHONUNBUFFERED, "value": "1"},
        {"name": E.JOB_NAME, "value": job.name},
        {"name": E.ATTEMPT, "value": str(attempt)},
        {"name": E.LOCAL_DIR, "value": f"{SCRATCH_DIR}/outputs"},
        {"name": E.MODEL_CACHE, "value": f"{SCRATCH_DIR}/models"},
    ]
    if storage.endpoint:
        env.append({"name": E.AWS_ENDPOINT_URL, "value": storage.endpoint})
    if storage.region:
        env += [{"name": E.AWS_REGION, "value": storage.region},
                {"name": E.AWS_DEFAULT_REGION, "value": storage.region}]
    if storage.credentials_secret_ref:
        secret = storage.credentials_secret_ref.name
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for key in (E.AWS_ACCESS_KEY_ID, E.AWS_SECRET_ACCESS_KEY)
        ]
    env += tracking_env.secret_env(spec)
    env += [_user_env(e) for e in res.env or []]
    return env


def _user_env(var: EnvVar) -> dict[str, Any]:
    if var.value_from is None:
        return {"name": var.name, "value": var.value or ""}
    return {"name": var.name, "valueFrom": var.value_from.model_dump(by_alias=True, exclude_none=True)}


def _resources(spec: api.SFTJobSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.cpu is not None:
        requests["cpu"] = str(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = res.memory
    if res.scratch.size is not None and not res.scratch.storage_class_name:
        # The emptyDir counts against the node's ephemeral storage: ask for it up front so
        # the pod lands where it fits, instead of being evicted for DiskPressure mid-run.
        requests["ephemeral-storage"] = res.scratch.size
    if res.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(res.gpus_per_node)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def config_hash(job: JobRef, spec: api.SFTJobSpec) -> str:
    return hashlib.sha256(config_text(job, spec).encode()).hexdigest()[:16]


def scratch_volume(spec: api.SFTJobSpec) -> dict[str, Any]:
    """The scratch volume's source: an emptyDir (size-limited when a size is given), or a
    generic ephemeral volume of the chosen StorageClass."""
    scratch = spec.resources.scratch
    if scratch.storage_class_name:
        return {"ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": scratch.storage_class_name,
            "resources": {"requests": {"storage": scratch.size}}}}}}
    return {"emptyDir": {"sizeLimit": scratch.size} if scratch.size else {}}


def build_pod(job: JobRef, spec: api.SFTJobSpec, rank: int, attempt: int,
              master_port: int = MASTER_PORT, metrics_port: int = METRICS_PORT,
              group: tuple[dict[str, str], dict[str, str]] | None = None) -> dict[str, Any]:
    """The pod of one node rank for one gang attempt. `group`: the (labels, annotations)
    of the attempt's Kueue pod group (queueing.pod_group), when the job is queued."""
    res = spec.resources
    name = pod_name(job, rank)
    meta = _metadata(job, name, **{LABEL_RANK: str(rank), LABEL_ATTEMPT: str(attempt)})
    meta["annotations"] = {"sftjob.io/config-hash": config_hash(job, spec)}
    if group:
        meta["labels"].update(group[0])
        meta["annotations"].update(group[1])
    ports = [{"name": "rendezvous", "containerPort": master_port}]
    if rank == 0:
        ports.append({"name": "metrics", "containerPort": metrics_port})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": res.image,
        "imagePullPolicy": res.image_pull_policy,
        "command": trainer_command(job, spec, rank, master_port),
        "env": _env(job, spec, rank, attempt, master_port),
        "ports": ports,
        "volumeMounts": [{"name": "config", "mountPath": command.CONFIG_DIR, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": config_map_name(job)}}]
    if spec.storage.persistent_volume_claim:
        # A path storage.uri lives on the user's claim, mounted at that path on every rank.
        container["volumeMounts"].append({"name": "storage", "mountPath": spec.storage.uri.rstrip("/")})
        volumes.append({"name": "storage",
                        "persistentVolumeClaim": {"claimName": spec.storage.persistent_volume_claim.claim_name}})
    container["volumeMounts"].append({"name": "scratch", "mountPath": SCRATCH_DIR})
    volumes.append({"name": "scratch", **scratch_volume(spec)})
    if res.gpus_per_node:
        # NCCL's shared-memory transport outgrows the container runtime's 64 MiB /dev/shm.
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    pod_spec: dict[str, Any] = {
        # The operator restarts the whole gang; a kubelet restart of one rank would hang the rest.
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job),
        "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    for key, value in (
        ("nodeSelector", res.node_selector),
        ("priorityClassName", res.priority_class_name),
        ("schedulerName", res.scheduler_name),
        ("serviceAccountName", res.service_account_name),
    ):
        if value:
            pod_spec[key] = value
    if res.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_pods(job: JobRef, spec: api.SFTJobSpec, attempt: int, master_port: int = MASTER_PORT,
               metrics_port: int = METRICS_PORT) -> list[dict[str, Any]]:
    return [build_pod(job, spec, rank, attempt, master_port, metrics_port) for rank in range(spec.resources.nodes)]
