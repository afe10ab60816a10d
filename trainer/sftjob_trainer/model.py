"""Model construction: from_pretrained, optional LoRA, the loss head, FSDP2 sharding.

Each step is a small function taking only the config it needs, so the order
(load → LoRA → loss head → activation checkpointing → shard → fill from rank 0) reads
top to bottom in `build_model`. With several processes only rank 0 reads the weights;
the others build on the meta device and receive their shards.

Three throughput pieces live here because they change how the model computes, not what:
- ``sdpa_varlen`` attention: a packed row (several sequences, positions restarting) runs
  causal sdpa once per sequence instead of one dense block-diagonal mask over the whole
  row, so no attention FLOPs are spent on blocks that are masked out anyway.
- `LossHead`: the LM head, which (while a loss is requested) returns the summed
  cross-entropy of its targets instead of logits, computed in vocabulary chunks so that
  ``[tokens, vocab]`` logits never exist at once (see `loss.py`). It stays inside the
  model's forward, so FSDP2 has the head's weight gathered while it runs.
- `widen_bf16_gemms`: on CPUs without native bf16, the bf16 autocast products of the linear
  layers, the head and the attention run as fp32 GEMMs of the exactly widened operands
  (precision.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .config import LoraConfig, ModelConfig
from .dist import World
from .errors import InvalidConfig
from .precision import WidenedBf16Linear, bf16_autocast_on, widened_linear, widened_sdpa

log = logging.getLogger(__name__)

VARLEN = "sdpa_varlen"


# --------------------------------------------------------------------------- attention


def sequence_bounds(kwargs: dict) -> list[int]:
    """Start offsets of the sequences in a packed row, plus its length at the end."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return [int(x) for x in cu.tolist()]
    pos = kwargs.get("position_ids")
    if pos is None:
        raise RuntimeError(f"{VARLEN} attention needs position_ids or cu_seq_lens_q to find sequence boundaries")
    row = pos.reshape(-1)
    starts = (row == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [row.numel()]


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal sdpa per sequence of a packed row; anything else goes to stock sdpa.

    query/key/value are [1, heads, tokens, head_dim]; the result is [1, tokens, heads, head_dim]
    like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    bounds = sequence_bounds(kwargs)
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    gqa = query.shape[1] != key.shape[1]
    widen = getattr(module, "widen_bf16", False) and bf16_autocast_on(query.device)
    sdpa = widened_sdpa if widen else F.scaled_dot_product_attention
    # split, not slicing: the backward of a split is one cat, while every slice's backward
    # would zero-fill and add a full-size gradient (a cost growing with sequences per row).
    parts = [
        sdpa(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def varlen_sdpa_mask(*args, attention_mask=None, **kwargs):
    """No mask for unpadded rows (the attention splits them by sequence); stock sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN, varlen_sdpa_mask)


def pick_attention(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN


# --------------------------------------------------------------------------- loss head


class LossHead(nn.Linear):
    """An LM head that returns the summed CE of ``targets`` while `computing_loss` is active.

    Outside that context it is the plain linear layer it replaced (same parameters and
    state-dict keys), so export, generation and checkpoints do not see a difference.
    """

    targets: torch.Tensor | None = None
    widen_bf16: bool = False

    @contextlib.contextmanager
    def computing_loss(self, targets: torch.Tensor):
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return widened_linear(hidden, self.weight, self.bias) if self.widen_bf16 else super().forward(hidden)
        from .loss import linear_ce_sum

        return linear_ce_sum(hidden, self.weight, self.targets, self.widen_bf16)


def install_loss_head(model: nn.Module) -> bool:
    """Turn a bias-free nn.Linear LM head into a `LossHead` in place; False if the head is something else."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None:
        log.info("LM head %s is not a plain linear layer: the loss is taken on materialised logits",
                 type(head).__name__)
        return False
    head.__class__ = LossHead
    return True


def loss_head(model: nn.Module) -> LossHead | None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return head if isinstance(head, LossHead) else None


def widen_bf16_gemms(model: nn.Module) -> None:
    """Make every bf16 autocast product of ``model`` a widened fp32 GEMM (precision.py).

    Plain linear layers (LoRA's included) become `WidenedBf16Linear`; the loss head and the
    ``sdpa_varlen`` attention (whatever its module class) read the ``widen_bf16`` flag."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WidenedBf16Linear
        module.widen_bf16 = True


# --------------------------------------------------------------------------- building


def load_model(cfg: ModelConfig, local_path: str, device: torch.device, weights: bool = True) -> nn.Module:
    """The model with its pretrained weights in CPU memory, or (``weights=False``) the same
    architecture on the meta device: no memory, filled later from rank 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_attention()
    attn = pick_attention(cfg, device)
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(
                local_path,
                dtype=torch.float32,  # fp32 master weights; bf16 is an autocast choice
                attn_implementation=attn,
                trust_remote_code=cfg.trust_remote_code,
            )
        else:
            config = AutoConfig.from_pretrained(local_path, trust_remote_code=cfg.trust_remote_code)
            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn,
                                                             trust_remote_code=cfg.trust_remote_code)
            except Exception as err:  # noqa: BLE001 - some remote code computes real values at init
                log.warning("cannot build %s on the meta device (%s); reading the weights on this rank too",
                            type(config).__name__, err)
                return load_model(cfg, local_path, device, weights=True)
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


def load_from_rank0(model: nn.Module, full_sd: dict | None, world: World) -> None:
    """Fill a sharded model whose non-zero ranks are still on the meta device.

    Parameters come from rank 0's full state dict (consumed as it goes), scattered so
    that each rank receives only its shard; buffers (persistent or not, e.g. rotary
    frequencies) are broadcast whole.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if world.rank != 0:
        model.to_empty(device=world.device)
    with torch.no_grad():
        # One parameter at a time, so no rank ever holds more than one full tensor beyond
        # its shards (torch's set_model_state_dict keeps every received tensor alive until
        # it returns: a whole extra copy of the model per rank).
        for name, param in model.named_parameters():
            full = (full_sd.pop(name).to(world.device) if world.rank == 0
                    else torch.empty(param.shape, dtype=param.dtype, device=world.device))
            if isinstance(param, DTensor):
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0)
                param.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(full, src=0)
                param.copy_(full)
            del full
        for _, buf in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            dist.broadcast(buf, src=0)


def build_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, local_path: str, world: World,
                widen_bf16: bool = False) -> nn.Module:
    """Only rank 0 reads the weights; the other ranks build the model on the meta device and
    receive their shards from rank 0 after sharding. A node's CPU memory then holds one
    full copy of the model, not one per process (8 GPUs × a 70B model in fp32 would not fit)."""
    from . import dist as dist_utils

    model, error = None, None
    try:
        model = load_model(model_cfg, local_path, world.device, weights=world.rank == 0)
    except InvalidConfig as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - e.g. a truncated safetensors file: retrying cannot help
        error = f"model.path {model_cfg.path}: cannot load a causal LM ({type(err).__name__}: {err})"
    if world.size > 1:  # every rank fails the same way, not only the one that read the files
        error = next((e for e in dist_utils.all_gather_objects(error) if e), None)
    if error:
        raise InvalidConfig(error)
    model = apply_lora(model, lora_cfg)
    # Rank 0's weights (LoRA ones included) as full tensors; sharding keeps them alive.
    full_sd = model.state_dict() if world.size > 1 and world.rank == 0 else None
    install_loss_head(model)
    if widen_bf16:
        widen_bf16_gemms(model)
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model = shard_model(model, world)
    if world.size > 1:
        load_from_rank0(model, full_sd, world)
        del full_sd
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
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is not None and emb is not None and head.weight is emb.weight:
        return total  # tied: the one table is both a lookup and the LM head's matmul
    return total - n_emb


def attention_dims(model: nn.Module) -> tuple[int, int]:
    """(number of layers, heads × head_dim) for the attention FLOPs term."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    c = inner.config
    heads = getattr(c, "num_attention_heads", 0)
    head_dim = getattr(c, "head_dim", None) or (c.hidden_size // max(heads, 1))
    return c.num_hidden_layers, heads * head_dim
