"""Process groups and rank-0 model loading: what torch itself makes of the trainer's choices."""
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


def test_other_ranks_build_the_model_without_weights(assets, monkeypatch):
    """Ranks other than 0 never read the weights: the model is built on the meta device
    (tests/trainer/test_training.py checks that rank 0 then fills it exactly). A model
    whose code cannot be built on meta is loaded normally instead."""
    from transformers import AutoModelForCausalLM

    from sftjob_contract.config import ModelConfig
    from sftjob_trainer.model import load_model

    cfg = ModelConfig(path=str(assets / "model"))
    cpu = torch.device("cpu")
    assert all(p.is_meta for p in load_model(cfg, cfg.path, cpu, weights=False).parameters())

    def refuses(*_a, **_k):
        raise RuntimeError("remote code that computes real values at init")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", refuses)
    fallback = load_model(cfg, cfg.path, cpu, weights=False)
    reference = load_model(cfg, cfg.path, cpu, weights=True)
    assert not any(p.is_meta for p in fallback.parameters())
    assert all(torch.equal(a, b) for a, b in zip(fallback.state_dict().values(), reference.state_dict().values()))
