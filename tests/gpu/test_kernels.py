"""The GPU kernels the trainer can choose, each against the default on the same batch, on a
one-rank NCCL group under FSDP2 with bf16 mixed precision:
- flash-attention varlen vs our per-sequence sdpa: the same loss and gradients within bf16
  tolerance (flash-attn must be installed: the trainer image has it);
- trainer.cpu_offload: five AdamW steps of the 0.5B Qwen2-shaped model give the same losses
  (same kernels: within 1e-3) at a lower peak GPU memory;
- model.liger_kernel: the same within bf16 tolerance (other kernels: 2e-2), peak not higher."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def test_flash_attention_and_sdpa_agree_on_a_packed_batch(gpu_assets, one_rank_group):
    import torch
    from transformers import AutoTokenizer

    from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig
    from sftjob_trainer.batching import collate
    from sftjob_trainer.data import SampleBuilder, SFTDataset
    from sftjob_trainer.dist import World
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model, decoder_layers

    assert importlib.util.find_spec("flash_attn") is not None, "flash-attn is not installed (the trainer image has it)"
    device = one_rank_group
    path = str(gpu_assets / "model")
    tok = AutoTokenizer.from_pretrained(path)
    f = str(gpu_assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], messages_key="messages", max_length=256)), "c")
    mb = collate([ds.sample(i) for i in range(16)], list(range(16)), packing=True, pad_id=tok.pad_token_id)
    results = {}
    for attn in ("flash_attention_2", "sdpa_varlen"):
        torch.manual_seed(0)
        cfg = ModelConfig(path=path).model_copy(update={"attn_implementation": attn})
        model = build_model(cfg, LoraConfig(), path, World(0, 0, 1, device), precision="bf16")
        assert model.config._attn_implementation == attn, f"asked for {attn}, got {model.config._attn_implementation}"
        seen: list[Any] = []
        q_proj = decoder_layers(model)[0].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(m.weight.dtype))
        ce = ce_sum(model, mb, device, "bf16")
        ce.backward()
        assert seen == [torch.bfloat16], f"{attn}: the forward saw {seen} weights, not bf16 (mixed precision)"
        grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
        results[attn] = (ce.item() / mb.n_targets, grads)
    (fl, fg), (sl, sg) = results["flash_attention_2"], results["sdpa_varlen"]
    assert abs(fl - sl) <= 1e-2 * abs(sl), f"loss flash {fl:.5f} vs sdpa {sl:.5f}"
    worst = max(((fg[n] - sg[n]).norm() / sg[n].norm().clamp_min(1e-12)).item() for n in sg)
    assert worst < 0.05, f"gradients differ by {worst:.3f} (relative norm) between flash and sdpa"
    print(f"{len(mb.seq_lengths)} sequences in one packed row ({mb.n_tokens} tokens): loss flash {fl:.5f} "
          f"vs sdpa {sl:.5f}; worst gradient rel. diff {worst:.4f}; FSDP2 gathered bf16 over NCCL")


def few_steps(path: Path, device: Any, steps: int = 5, offload: bool = False,
              liger: bool = False) -> tuple[list[float], float]:
    """Losses of ``steps`` AdamW steps on one fixed packed batch, and the peak GPU memory (GiB),
    for the model built with the options, on an initialised one-rank group."""
    import torch

    from sftjob_contract.config import LoraConfig, ModelConfig, OptimConfig
    from sftjob_trainer.batching import MicroBatch
    from sftjob_trainer.dist import World
    from sftjob_trainer.errors import InvalidConfig
    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.model import build_model, check_device_options
    from sftjob_trainer.optim import build_optimizer

    try:
        check_device_options(liger, offload, device)
    except InvalidConfig as err:  # e.g. liger-kernel missing from this environment
        pytest.fail(str(err))
    torch.manual_seed(0)
    lengths = [1024, 2048, 512, 512]
    ids = torch.randint(3, 5000, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    mb = MicroBatch(ids, targets, positions, None, [0], sum(lengths), sum(lengths) - 1, lengths)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cfg = ModelConfig(path=str(path), liger_kernel=liger)
    model = build_model(cfg, LoraConfig(), str(path), World(0, 0, 1, device), precision="bf16", offload=offload)
    opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-4), fused=False)
    out = []
    for _ in range(steps):
        ce = ce_sum(model, mb, device, "bf16")
        (ce / mb.n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(ce.item() / mb.n_targets)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    return out, peak


@pytest.mark.parametrize(("option", "rtol", "lower"), [("offload", 1e-3, True), ("liger", 2e-2, False)])
def test_an_option_keeps_the_losses_and_does_not_raise_the_peak_memory(option, rtol, lower, bench_model,
                                                                        one_rank_group):
    base, base_peak = few_steps(bench_model, one_rank_group)
    got, peak = few_steps(bench_model, one_rank_group, **{option: True})
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, base))
    assert worst <= rtol, f"losses with {option} {got} vs without {base}: {worst:.1e} apart (> {rtol:g})"
    assert (peak < base_peak) if lower else (peak <= base_peak * 1.02), \
        f"peak GPU memory {peak:.2f} GiB with {option}, {base_peak:.2f} GiB without"
    print(f"losses {base[0]:.4f} -> {base[-1]:.4f} without, {got[0]:.4f} -> {got[-1]:.4f} with {option} "
          f"(max rel. diff {worst:.1e}); peak GPU memory {base_peak:.2f} -> {peak:.2f} GiB")
