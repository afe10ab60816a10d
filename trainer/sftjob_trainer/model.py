"""Model construction: from_pretrained, optional LoRA, FSDP2 sharding.

Each step is a small function taking only the config it needs, so the order
(load → LoRA → activation checkpointing → shard) reads top to bottom in `build_model`.
"""
from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from .config import LoraConfig, ModelConfig
from .dist import World
from .errors import InvalidConfig

log = logging.getLogger(__name__)


def pick_attention(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(cfg: ModelConfig, local_path: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    attn = pick_attention(cfg, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            local_path,
            dtype=torch.float32,  # fp32 master weights; bf16 is an autocast choice
            attn_implementation=attn,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as err:
        raise InvalidConfig(f"model.path {cfg.path}: cannot load a causal LM ({err})") from None
    # KV caching is for generation only; training never uses it.
    model.config.use_cache = False
    return model


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    if cfg.rank == 0:
        return model
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        model = get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise InvalidConfig(f"lora.target_modules: {err}") from None
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found the way most HF causal LMs name them."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "transformer.blocks"):
        node = inner
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        if isinstance(node, nn.ModuleList) and len(node):
            return list(node)
    raise InvalidConfig(f"cannot find the decoder layers of {type(inner).__name__} to shard them")


def enable_activation_checkpointing(model: nn.Module) -> None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        # With frozen embeddings (LoRA) checkpointed blocks need an input that requires grad.
        model.enable_input_require_grads()


def shard_model(model: nn.Module, world: World) -> nn.Module:
    """FSDP2: one `fully_shard` per decoder layer, then the root."""
    if world.size == 1:
        return model.to(world.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, local_path: str, world: World) -> nn.Module:
    model = load_model(model_cfg, local_path, world.device)
    model = apply_lora(model, lora_cfg)
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model = shard_model(model, world)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, %.2fM trainable", model_cfg.path, total / 1e6, trainable / 1e6)
    return model


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matmuls (all but input embeddings): the 6·N of MFU."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = inner.get_input_embeddings()
    n_emb = emb.weight.numel() if emb is not None else 0
    total = sum(p.numel() for n, p in inner.named_parameters() if "lora_" not in n)
    return total - n_emb


def attention_dims(model: nn.Module) -> tuple[int, int]:
    """(number of layers, heads × head_dim) for the attention FLOPs term."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    c = inner.config
    heads = getattr(c, "num_attention_heads", 0)
    head_dim = getattr(c, "head_dim", None) or (c.hidden_size // max(heads, 1))
    return c.num_hidden_layers, heads * head_dim
