"""trainer.fsdp_gather (gather.py): the choice as a table, the memory it reads, and FSDP2's
collectives and gradients for a step of several micro-batches, per layer and per step.

The FSDP tests run FSDP2 in this process on a one-rank gloo group (test_fsdp.py's way: the
same all-gather and reduce-scatter code path as N ranks); test_training.py trains on two
real ranks both ways."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sftjob_contract.config import SFTConfig
from sftjob_trainer import gather

from .test_fsdp import CPU, _build, _packed

pytestmark = pytest.mark.unit
MiB = 2**20


@pytest.mark.parametrize("setting, extra, memory, sharded, offload, per_step, says", [
    ("auto", 100 * MiB, 1000 * MiB, True, False, True, "per step (auto: the gathered model and its gradients, 100 MiB, "
                                                        "fit in 10% of 1,000 MiB per rank)"),
    ("auto", 101 * MiB, 1000 * MiB, True, False, False, "per layer and micro-batch (auto: the gathered model and its "
                                                         "gradients, 101 MiB, exceed 10% of 1,000 MiB per rank)"),
    ("auto", 1 * MiB, 1000 * MiB, True, True, False, "trainer.cpu_offload keeps the model off the accelerator"),
    ("auto", 1 * MiB, 1000 * MiB, False, False, False, "one process: the model is not sharded"),
    ("per_step", 900 * MiB, 1000 * MiB, True, False, True, "per step (trainer.fsdp_gather=per_step; holds 900 MiB"),
    ("per_step", 1 * MiB, 1000 * MiB, False, False, False, "one process"),
    ("per_layer", 1 * MiB, 1000 * MiB, True, False, False, "per layer and micro-batch (trainer.fsdp_gather=per_layer)"),
])
def test_the_choice(setting, extra, memory, sharded, offload, per_step, says):
    got, why = gather.choose(setting, extra, memory, sharded, offload)
    assert got is per_step
    assert says in why


def test_per_step_with_cpu_offload_is_refused_naming_both_fields():
    base = {"model": {"path": "m"}, "data": {"train_files": ["t.parquet"]}, "trainer": {"output_dir": "/o"}}
    with pytest.raises(ValueError, match="trainer.fsdp_gather=per_step .* trainer.cpu_offload"):
        SFTConfig.model_validate(base | {"trainer": {"output_dir": "/o", "fsdp_gather": "per_step",
                                                     "cpu_offload": True}})
    assert SFTConfig.model_validate(base).trainer.fsdp_gather == "auto"


@pytest.mark.parametrize("files, want", [
    ({"memory.max": "max\n"}, None),
    ({"memory.max": "8589934592\n"}, 8 << 30),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),   # v1's "no limit"
    ({"memory/memory.limit_in_bytes": "4294967296\n"}, 4 << 30),
    ({}, None),
])
def test_the_pod_memory_limit_is_read_from_either_cgroup_version(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert gather.cgroup_memory_limit(tmp_path) == want


def test_a_rank_gets_its_share_of_the_host_memory():
    one, two = gather.rank_memory_bytes(CPU, 1), gather.rank_memory_bytes(CPU, 2)
    assert 0 < two <= one // 2 + 1


def _count(monkeypatch) -> dict[str, int]:
    """Gathers (a parameter group going from sharded to unsharded: on one rank FSDP2 skips the
    all-gather call itself but not the transition) and gradient reductions."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    calls = {"gather": 0, "reduce": 0}
    to_unsharded = param_group.FSDPParamGroup._to_unsharded

    def gathered(self):
        calls["gather"] += not self.is_unsharded
        return to_unsharded(self)

    real_reduce = param_group.foreach_reduce

    def reduced(*args, **kwargs):
        calls["reduce"] += 1
        return real_reduce(*args, **kwargs)

    monkeypatch.setattr(param_group.FSDPParamGroup, "_to_unsharded", gathered)
    monkeypatch.setattr(param_group, "foreach_reduce", reduced)
    return calls


def _step(assets, precision: str, per_step: bool, monkeypatch):
    """One step of 3 micro-batches through gather.micro_batches: (collective counts, full gradients,
    whether every parameter is sharded again after it)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import decoder_layers

    model = _build(assets / "model", precision)
    batches = [_packed(assets / "model", assets, rows=r) for r in (3, 4, 5)]
    calls = _count(monkeypatch)
    plan = gather.Plan(model, per_step)
    for mb in plan.micro_batches(batches):
        ce_sum(model, mb, CPU, precision).backward()
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]
    sharded = all(p.sharded_state == ShardedState.SHARDED for g in groups for p in g.fsdp_params)
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    monkeypatch.undo()
    return dict(calls), grads, sharded, len(decoder_layers(model))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_per_step_gathers_and_reduces_once_a_step_for_the_same_gradients(assets, one_rank_group, monkeypatch,
                                                                           precision):
    layer_calls, layer_grads, layer_sharded, n = _step(assets, precision, False, monkeypatch)
    step_calls, step_grads, step_sharded, _ = _step(assets, precision, True, monkeypatch)
    groups = n + 1  # each decoder layer and the root (embeddings, final norm, head)
    # per layer: each layer gathered for its forward and again for its backward, the root once (FSDP2 keeps
    # the root gathered between them), every group reduced, for each of the 3 micro-batches
    assert layer_calls == {"gather": 3 * (2 * n + 1), "reduce": 3 * groups}, layer_calls
    assert step_calls == {"gather": groups, "reduce": groups}, step_calls
    assert layer_sharded and step_sharded
    # one rank: the same sums in the same order (bf16 micro-batch gradients accumulate in fp32 either way)
    assert layer_grads.keys() == step_grads.keys()
    for name, want in layer_grads.items():
        assert torch.equal(step_grads[name], want), name


def test_the_trainer_plans_per_layer_for_one_process(assets):
    from sftjob_contract.config import TrainerConfig
    from sftjob_trainer.dist import World

    assert not dist.is_initialized()
    model = _build(assets / "model", "fp32")
    plan = gather.plan(model, TrainerConfig(output_dir="/o", fsdp_gather="per_step"), World(0, 0, 1, CPU))
    assert plan.per_step is False and list(plan.micro_batches([1, 2])) == [1, 2]
