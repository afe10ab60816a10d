"""Environment variable names shared by the operator's pods, torchrun and the trainer.

The operator sets the rendezvous, storage and `SFTJOB_*` variables on every trainer pod
(`builders._env`); the launcher and the trainer read them. torchrun sets the per-process
`RANK`, `WORLD_SIZE` and `LOCAL_RANK` for each trainer process (the pod-level `RANK` and
`WORLD_SIZE` the operator sets count node ranks, as in a PyTorchJob).
"""
from __future__ import annotations

# Rendezvous and process layout.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
WORLD_SIZE = "WORLD_SIZE"
RANK = "RANK"
NODE_RANK = "NODE_RANK"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NPROC_PER_NODE = "NPROC_PER_NODE"
# torchrun's SIGTERM -> SIGKILL escalation for its workers, in seconds.
TORCH_ELASTIC_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"

# Object storage (the standard AWS names, read by boto3 and by the trainer's storage code).
AWS_ENDPOINT_URL = "AWS_ENDPOINT_URL"
AWS_REGION = "AWS_REGION"
AWS_DEFAULT_REGION = "AWS_DEFAULT_REGION"
AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
AWS_SESSION_TOKEN = "AWS_SESSION_TOKEN"  # with temporary credentials

# The job's identity, set by the operator for logs and tools in the pod.
JOB_NAME = "SFTJOB_JOB_NAME"
ATTEMPT = "SFTJOB_ATTEMPT"
# Read by the launcher: the trainer's SIGTERM-to-exit budget (the default for
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and how long to wait for --master-addr to resolve.
STOP_TIMEOUT_S = "SFTJOB_STOP_TIMEOUT_S"
RENDEZVOUS_TIMEOUT_S = "SFTJOB_RENDEZVOUS_TIMEOUT_S"
# Read by the trainer: where its one-line termination message goes (exits.TERMINATION_LOG),
# "json" for JSON log lines, node-local scratch for s3:// outputs, the per-node model cache.
TERMINATION_LOG = "SFTJOB_TERMINATION_LOG"
LOG_FORMAT = "SFTJOB_LOG_FORMAT"
LOCAL_DIR = "SFTJOB_LOCAL_DIR"
MODEL_CACHE = "SFTJOB_MODEL_CACHE"
# Attempts per object-storage operation before a transient failure ends the run (default 8).
S3_ATTEMPTS = "SFTJOB_S3_ATTEMPTS"

# What a user may not set in spec.resources.env (the CRD refuses them): the operator or
# torchrun sets these, and a user's value would silently break the rendezvous or the storage.
RESERVED = (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, NODE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, NPROC_PER_NODE,
            TORCH_ELASTIC_SHUTDOWN_TIMEOUT, PYTHONUNBUFFERED, AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION)
RESERVED_PREFIX = "SFTJOB_"
