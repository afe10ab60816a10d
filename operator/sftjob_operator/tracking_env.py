"""spec.tracking on the pods: the trainer's `tracking` section and the Secret references.

Pure builders, called by builders.py. Two rules hold here:
- a job that tracks nothing gets neither a `tracking` key in its config nor a variable in its
  pods, so the config and pods of every existing job stay byte for byte what they were;
- a credential reaches a pod only as a `secretKeyRef` to the Secret the spec names, never as a
  value in the config, the ConfigMap or the pod spec.
"""
from __future__ import annotations

from typing import Any

from sftjob_contract import tracking as T

from . import api


def trainer_section(spec: api.SFTJobSpec, namespace: str, name: str) -> dict[str, Any]:
    """`{"tracking": {...}}` for the trainer's config, with the defaults that need the job's
    identity filled in (experiment and W&B project: the namespace; run name: the job's name);
    `{}` when no backend is on."""
    t = spec.tracking
    if not (t.tensorboard or t.mlflow or t.wandb):
        return {}
    out: dict[str, Any] = {"tensorboard": t.tensorboard}
    if t.mlflow is not None:
        out["mlflow"] = {**t.mlflow.model_dump(exclude_none=True),
                         "experiment": t.mlflow.experiment or namespace, "run_name": t.mlflow.run_name or name}
    if t.wandb is not None:
        out["wandb"] = {**t.wandb.model_dump(exclude_none=True), "project": t.wandb.project or namespace}
    return {"tracking": out}


def secret_env(spec: api.SFTJobSpec) -> list[dict[str, Any]]:
    """The tracking credentials as `secretKeyRef`s. MLflow's keys are each optional (a token,
    or a user and a password); W&B's API key is required once its Secret is named."""
    t = spec.tracking
    env: list[dict[str, Any]] = []
    if t.mlflow is not None and t.mlflow.credentials_secret:
        env += [_ref(key, t.mlflow.credentials_secret, optional=True) for key in T.MLFLOW_SECRET_KEYS]
    if t.wandb is not None and t.wandb.api_key_secret:
        env += [_ref(key, t.wandb.api_key_secret, optional=False) for key in T.WANDB_SECRET_KEYS]
    return env


def _ref(key: str, secret: str, optional: bool) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": key, "valueFrom": {"secretKeyRef": ref}}
