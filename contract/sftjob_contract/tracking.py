"""The `tracking` section of the trainer's config: where a run's curves and parameters go
for practitioners to compare (TensorBoard event files, an MLflow run, a W&B run).

Part of the contract: the operator derives `spec.tracking` from these models (api.py) and
fills the defaults that need the job's identity (the experiment is the namespace, the run
is named after the job). Credentials are never fields: a field names a Secret, the operator
injects its keys into the pods as `secretKeyRef`s (the variable names below), and the
trainer reads them from its environment.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .sections import _Section

__all__ = ["HTTP_URI", "MlflowConfig", "TrackingConfig", "WandbConfig", "MLFLOW_SECRET_KEYS", "WANDB_SECRET_KEYS"]

# An http(s) URL with a host: what an MLflow tracking server answers on.
HTTP_URI = r"^https?://[^/\s:?#@]+(:[0-9]{1,5})?(/\S*)?$"
# A Secret's name (RFC 1123 subdomain), as the API server validates object names.
_SECRET_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

# The environment variables the tracking clients read their credentials from, and so the
# Secret keys the operator maps onto them (each optional: a token, or a user and password).
MLFLOW_TRACKING_TOKEN = "MLFLOW_TRACKING_TOKEN"
MLFLOW_TRACKING_USERNAME = "MLFLOW_TRACKING_USERNAME"
MLFLOW_TRACKING_PASSWORD = "MLFLOW_TRACKING_PASSWORD"
MLFLOW_SECRET_KEYS = (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD)
WANDB_API_KEY = "WANDB_API_KEY"
WANDB_SECRET_KEYS = (WANDB_API_KEY,)


class MlflowConfig(_Section):
    """One MLflow run per job, across all its attempts (found again by the job's identity)."""

    tracking_uri: str = Field(
        min_length=1, max_length=1024, pattern=HTTP_URI,
        description="The MLflow tracking server's http(s) URL, e.g. http://mlflow.mlflow:5000.",
    )
    experiment: str | None = Field(
        default=None, min_length=1, max_length=500,
        description="MLflow experiment to log into, created if missing (default: the job's namespace).",
    )
    run_name: str | None = Field(
        default=None, min_length=1, max_length=250,
        description="Display name of the job's MLflow run (default: the job's name).",
    )
    credentials_secret: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_SECRET_NAME,
        description="Secret in the job's namespace with the key MLFLOW_TRACKING_TOKEN, or the keys "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; injected into the pods with secretKeyRef, never "
        "written into the config. Empty: the server is reached without credentials.",
    )


class WandbConfig(_Section):
    """One Weights & Biases run per job, resumed by an id derived from the job's identity."""

    project: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="W&B project to log into (default: the job's namespace).",
    )
    entity: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="W&B entity (user or team) owning the project (default: the API key's default entity).",
    )
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="online streams to the W&B server; offline writes the run under the W&B directory "
        "(WANDB_DIR) for a later `wandb sync`.",
    )
    api_key_secret: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=_SECRET_NAME,
        description="Secret in the job's namespace with the key WANDB_API_KEY, injected into the pods with "
        "secretKeyRef. Needed for online mode unless the pods carry the key by other means.",
    )


class TrackingConfig(_Section):
    """Experiment tracking: rank 0 logs per-step loss, learning rate, gradient norm and
    throughput, every validation loss, the run's parameters and the exported model's URI.
    A tracking backend that is down never stops training."""

    tensorboard: bool = Field(
        default=False,
        description="Write TensorBoard event files under <output_dir>/tensorboard/ (copied there at every "
        "checkpoint commit and at the end), so that `tensorboard --logdir <output_dir>/tensorboard` shows the run.",
    )
    mlflow: MlflowConfig | None = Field(default=None, description="Log to an MLflow tracking server (unset: off).")
    wandb: WandbConfig | None = Field(default=None, description="Log to Weights & Biases (unset: off).")

    @property
    def enabled(self) -> bool:
        """Whether any backend is on."""
        return self.tensorboard or self.mlflow is not None or self.wandb is not None
