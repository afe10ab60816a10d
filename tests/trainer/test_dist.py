"""Process-group backends: what torch itself makes of the trainer's choice."""
import pytest
import torch
from torch.distributed.distributed_c10d import BackendConfig

from sftjob_trainer.dist import backend_for

pytestmark = pytest.mark.unit


def test_gpu_runs_route_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl():
    # The trainer all-reduces CPU tensors (token counts, losses, the SIGTERM flag); with
    # NCCL alone every one of them would fail on a multi-GPU job.
    routes = BackendConfig(backend_for(torch.device("cuda", 0))).get_device_backend_map()
    assert routes == {"cpu": "gloo", "cuda": "nccl"}


def test_cpu_runs_use_gloo():
    assert BackendConfig(backend_for(torch.device("cpu"))).get_device_backend_map()["cpu"] == "gloo"
