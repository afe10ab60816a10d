"""FSDP2 as the trainer applies it: bf16 mixed precision and per-layer activation checkpointing.

These run FSDP2 in this process on a one-rank gloo group (the same `shard_model` code path
as N ranks: all-gather, reduce-scatter, DTensor shards); test_training.py and
test_precision.py run the same choices on two real ranks.
"""
from __future__ import annotations

import inspect
import shutil

import pytest
import torch

from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig, OptimConfig
from sftjob_trainer.data import SampleBuilder, SFTDataset
from sftjob_trainer.batching import collate
from sftjob_trainer.dist import World

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _deep_model(assets, tmp_path, layers: int):
    """The assets' tokenizer with a deeper model (more layers make activations dominate)."""
    from transformers import AutoTokenizer

    from tools.assets import make_model

    out = tmp_path / f"model{layers}"
    shutil.copytree(assets / "model", out)
    make_model(out, AutoTokenizer.from_pretrained(out), seed=0, layers=layers)
    return out


def _packed(model_dir, assets, rows: int = 8):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    f = str(assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], messages_key="messages", max_length=128)), "t")
    return collate([ds.sample(i) for i in range(rows)], list(range(rows)), packing=True, pad_id=tok.pad_token_id)


def _build(path, precision: str, ckpt: bool = False, lora: bool = False):
    from sftjob_trainer.model import build_model

    lora_cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) if lora else LoraConfig()
    torch.manual_seed(0)
    return build_model(ModelConfig(path=str(path), gradient_checkpointing=ckpt), lora_cfg, str(path),
                       World(0, 0, 1, CPU), precision=precision)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_gathers_bf16_params_and_reduces_fp32_grads_into_fp32_shards(assets, one_rank_group, monkeypatch, lora):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.tensor import DTensor

    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import decoder_layers
    from sftjob_trainer.optim import build_optimizer

    model = _build(assets / "model", "bf16", lora=lora)
    mb = _packed(assets / "model", assets)
    # what the forward computes with: the gathered weights of a projection (LoRA's frozen base included)
    seen = {}
    attn = decoder_layers(model)[0].self_attn
    for name in ("q_proj", "o_proj"):
        proj = getattr(attn, name)
        weight_of = (lambda m: m.base_layer.weight) if lora and name == "q_proj" else (lambda m: m.weight)
        proj.register_forward_pre_hook(lambda m, a, n=name, w=weight_of: seen.update({n: w(m).dtype}))
    # what FSDP2's gradient reduction receives and reduces in
    reductions = []
    real = param_group.foreach_reduce

    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        reductions.append(({g.dtype for g in bound.arguments["unsharded_grads"]}, bound.arguments["reduce_dtype"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(param_group, "foreach_reduce", spy)
    optimizer = build_optimizer(model.parameters(), OptimConfig(), fused=False)
    ce_sum(model, mb, CPU, "bf16").backward()

    assert seen == {"q_proj": BF16, "o_proj": BF16}, seen
    assert reductions and all(got == {BF16} and reduce == torch.float32 for got, reduce in reductions), reductions
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.is_floating_point() and t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)


def test_fp32_runs_gather_fp32(assets, one_rank_group):
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import decoder_layers

    model = _build(assets / "model", "fp32")
    seen = []
    decoder_layers(model)[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    ce_sum(model, _packed(assets / "model", assets), CPU, "fp32").backward()
    assert seen == [torch.float32]


def _saved_bytes_and_grads(model, mb, precision):
    """Bytes autograd keeps for the backward pass (as seen from outside the model), and the grads."""
    from sftjob_trainer.loss import ce_sum

    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ce = ce_sum(model, mb, CPU, precision)
    ce.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return sum(saved), ce.item(), grads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_under_fsdp2_saves_a_tenth_or_less(assets, tmp_path, one_rank_group, precision):
    """8 layers: with checkpointing each layer keeps only its input (held by the checkpoint),
    so what autograd saves for the backward pass falls to ≤ 1/10 (measured: ~4 %); loss and gradients are those
    of the run without it (the recomputation is the same arithmetic)."""
    path = _deep_model(assets, tmp_path, layers=8)
    mb = _packed(path, assets)
    plain_bytes, plain_loss, plain_grads = _saved_bytes_and_grads(_build(path, precision), mb, precision)
    ckpt_bytes, ckpt_loss, ckpt_grads = _saved_bytes_and_grads(_build(path, precision, ckpt=True), mb, precision)
    assert ckpt_bytes <= plain_bytes / 10, (ckpt_bytes, plain_bytes)
    assert ckpt_loss == plain_loss
    for name, want in plain_grads.items():
        assert torch.equal(ckpt_grads[name], want), name
