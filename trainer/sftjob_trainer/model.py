"""Model construction: from_pretrained, optional LoRA, the loss head, FSDP2 sharding.

Each step is a small function taking only the config it needs, so the order
(load → LoRA → loss head → activation checkpointing → shard → fill from rank 0) reads
top to bottom in `build_model`. With several processes only rank 0 reads the weights;
the others build on the meta device and receive their shards.

What this file decides for a run:
- the attention kernel (attention.py: flash-attention only for bf16 on CUDA, else
  ``sdpa_varlen``, our per-sequence sdpa for packed rows);
- the loss head (`loss.LossHead`, installed here): the LM head, which (while a loss is requested) returns the summed
  cross-entropy of its targets instead of logits, computed in vocabulary chunks so that
  ``[tokens, vocab]`` logits never exist at once (see `loss.py`). It stays inside the
  model's forward, so FSDP2 has the head's weight gathered while it runs.
- `widen_bf16_gemms`: on CPUs without native bf16, the bf16 autocast products of the linear
  layers, the head and the attention run as fp32 GEMMs of the exactly widened operands
  (precision.py).
- per decoder layer, in this order inside each layer's FSDP2 unit: ``torch.compile``
  (trainer.compile), then activation checkpointing (model.gradient_checkpointing). Both
  replace only the layer's ``forward`` attribute, so module names, state-dict keys and
  checkpoints do not change, and FSDP2's hooks stay outside both (as in torchtitan, where the
  checkpoint wrapper sits inside ``fully_shard``): the layer's parameters are gathered before
  its forward, and before its recomputation in the backward pass.
- FSDP2 with the run's `MixedPrecisionPolicy` (precision.py): bf16 runs gather bf16
  parameters and reduce fp32 gradients into fp32 shards.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import shutil
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from sftjob_contract.config import LoraConfig, ModelConfig

from . import ulysses
from .attention import pick_attention, register_attention
from .dist import World
from .errors import InvalidConfig
from .loss import install_loss_head
from .modelcache import with_weights
from .precision import WidenedBf16Linear, fsdp_mixed_precision
from .unwrap import model_config, output_head, unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def widen_bf16_gemms(model: nn.Module) -> None:
    """Make every bf16 autocast product of ``model`` a widened fp32 GEMM (precision.py).

    Plain linear layers (LoRA's included) become `WidenedBf16Linear`; the loss head and the
    ``sdpa_varlen`` attention (whatever its module class) read the ``widen_bf16`` flag."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WidenedBf16Linear
        # torch annotates nn.Module.__setattr__'s value as Tensor | Module; any other value is
        # stored as a plain attribute.
        module.widen_bf16 = True  # type: ignore[assignment]  # torch's __setattr__ annotation: see above


# --------------------------------------------------------------------------- GPU-only options

LIGER_FIELD, OFFLOAD_FIELD = "model.liger_kernel", "trainer.cpu_offload"


def check_device_options(liger: bool, offload: bool, device: torch.device, compiled: bool = False) -> None:
    """Refuse, before anything is loaded, what only a GPU run can do (the API server refuses
    both for CPU jobs too; this catches a trainer started by hand), and kernels this image
    cannot build (check_compilers)."""
    if offload and device.type != "cuda":
        raise InvalidConfig(f"{OFFLOAD_FIELD}: CPU offload moves GPU-resident states to host memory; on a CPU "
                            f"run ({device.type}) everything is in host memory already. Set it to false")
    if liger and device.type != "cuda":
        raise InvalidConfig(f"{LIGER_FIELD}: Liger's kernels are Triton GPU kernels; this run has no GPU "
                            f"({device.type}). Set it to false")
    if liger and importlib.util.find_spec("liger_kernel") is None:
        raise InvalidConfig(f"{LIGER_FIELD}: the liger-kernel package is not installed in this image "
                            f"(pip install liger-kernel==0.8.5), or set it to false")
    check_compilers(compiled, liger, device)


COMPILE_FIELD = "trainer.compile"


def _compiler(env: str, names: tuple[str, ...]) -> str | None:
    """The compiler a run-time kernel build would use: ``$env`` if set, else the first of
    ``names`` on PATH (inductor's C++ search: $CXX else g++; Triton's: $CC else gcc, clang)."""
    if chosen := os.environ.get(env):
        return shutil.which(chosen)
    return next((found for name in names if (found := shutil.which(name))), None)


def check_compilers(compiled: bool, liger: bool, device: torch.device) -> None:
    """trainer.compile and Liger build kernels at the first step; refuse, before anything is
    loaded, an image that lacks the compiler they need. That failure used to come at the first
    step as a plain (retryable) error, so every gang restart loaded the model to fail again."""
    if compiled and device.type == "cpu" and _compiler("CXX", ("g++",)) is None:
        raise InvalidConfig(f"{COMPILE_FIELD}: torch.compile on the CPU builds its kernels with a C++ compiler, "
                            f"and this image has none ($CXX, else g++ on PATH; the project's CPU trainer image "
                            f"has none). Use an image with g++ and the Python headers, or set it to false")
    if (compiled or liger) and device.type == "cuda" and _compiler("CC", ("gcc", "clang")) is None:
        raise InvalidConfig(f"{COMPILE_FIELD if compiled else LIGER_FIELD}: Triton builds its kernels' launcher "
                            f"with a C compiler, and this image has none ($CC, else gcc or clang on PATH). Use an "
                            f"image with gcc and the Python headers, or set it to false")


def apply_liger(model: nn.Module) -> None:
    """Liger's fused RMSNorm, SwiGLU and RoPE on the model instance (before LoRA wraps it).

    Its cross-entropies are left off: our `loss.LossHead` already takes the CE in chunks that
    never hold [tokens, vocab] logits, and it is what FSDP and the SP slices are built around."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise InvalidConfig(f"{LIGER_FIELD}: Liger has no kernels for model_type {model_type!r} (it supports "
                            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set it to false")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    log.info("Liger kernels (RMSNorm, SwiGLU, RoPE) applied to the %s model", model_type)


# --------------------------------------------------------------------------- building


def load_model(cfg: ModelConfig, local_path: str, device: torch.device, weights: bool = True,
               precision: str = "fp32", sp: int = 1, skeleton: bool = False) -> nn.Module:
    """The model with its pretrained weights in CPU memory, or (``weights=False``) the same
    architecture on the meta device: no memory, filled later from rank 0. With sequence
    parallelism (``sp`` > 1) its attention is the Ulysses wrapper around the picked kernel.

    ``skeleton`` (with ``weights=False``): built from the config alone in CPU memory, its
    buffers (rotary tables) computed and its parameters allocated but not initialised, for a
    resume that overwrites every parameter from the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_attention()
    attn = pick_attention(cfg.attn_implementation, device, precision)
    try:
        if sp > 1:
            ulysses.check_heads(AutoConfig.from_pretrained(local_path, trust_remote_code=cfg.trust_remote_code), sp)
            attn = ulysses.register(attn)
        if weights:
            model = AutoModelForCausalLM.from_pretrained(
                local_path,
                dtype=torch.float32,  # fp32 master weights; bf16 is an autocast choice
                attn_implementation=attn,
                trust_remote_code=cfg.trust_remote_code,
            )
        elif skeleton:
            config = AutoConfig.from_pretrained(local_path, trust_remote_code=cfg.trust_remote_code)
            with _no_init():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn,
                                                         trust_remote_code=cfg.trust_remote_code)
            model.tie_weights()  # skipped with the initialisation: tied embeddings stay one parameter
        else:
            config = AutoConfig.from_pretrained(local_path, trust_remote_code=cfg.trust_remote_code)
            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn,
                                                             trust_remote_code=cfg.trust_remote_code)
            except Exception as err:  # noqa: BLE001 - some remote code computes real values at init
                log.warning("cannot build %s on the meta device (%s); reading the weights on this rank too",
                            type(config).__name__, err)
                # This node's cache may hold no weights (only rank 0 was to read them): fetch them now.
                return load_model(cfg, with_weights(local_path), device, weights=True, precision=precision, sp=sp)
    except (OSError, ValueError) as err:
        raise InvalidConfig(f"model.path {cfg.path}: cannot load a causal LM ({err})") from None
    # KV caching is for generation only; training never uses it.
    model.config.use_cache = False
    return model


def _no_init():
    """transformers' context that skips the random initialisation of a model built from its
    config (the parameters are overwritten anyway); a plain initialisation where it is missing."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(where).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


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
    inner = unwrap(model)
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
    """Recompute each decoder layer's activations in the backward pass: only the layer's
    inputs are saved (non-reentrant checkpoint, so frozen LoRA inputs need no grad)."""
    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer's forward (the norms, activations, rotary and casts
    around its matmuls fuse). ``sdpa_varlen`` attention stays eager (attention.py); the token
    count of a packed row varies, so shapes are dynamic from the first compile."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def shard_model(model: nn.Module, world: World, precision: str = "fp32", offload: bool = False) -> nn.Module:
    """FSDP2: one `fully_shard` per decoder layer, then the root, all with the precision's
    `MixedPrecisionPolicy`. Without a process group (one process) the model stays whole,
    unless ``offload`` (trainer.cpu_offload): FSDP2's `CPUOffloadPolicy` keeps the sharded
    parameters, their gradients and the optimizer state in pinned host memory, so a single
    GPU gets a one-rank group for it.

    The mesh is the whole world also with sequence parallelism (see ulysses.py for why)."""
    import torch.distributed as dist

    if not dist.is_initialized() and not offload:
        return model.to(world.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=world.device)
    mesh = init_device_mesh(world.device.type, (dist.get_world_size(),))
    opts = dict(mp_policy=fsdp_mixed_precision(precision),
                offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **opts)
    fully_shard(model, mesh=mesh, **opts)
    return model


def load_from_rank0(model: nn.Module, full_sd: dict | None, world: World, offload: bool = False,
                    params: bool = True) -> None:
    """Fill a sharded model whose non-zero ranks are still on the meta device.

    Parameters come from rank 0's full state dict (consumed as it goes), scattered so
    that each rank receives only its shard; buffers (persistent or not, e.g. rotary
    frequencies) are broadcast whole. ``params=False``: buffers only (a checkpoint
    fills the parameters next).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if world.rank != 0:
        # Offloaded shards live in host memory; the buffers (rotary tables) stay on the GPU.
        model.to_empty(device="cpu" if offload else world.device)
        if offload:
            for module in model.modules():
                for key, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[key] = buf.to(world.device)
    with torch.no_grad():
        # One parameter at a time, so no rank ever holds more than one full tensor beyond
        # its shards (torch's set_model_state_dict keeps every received tensor alive until
        # it returns: a whole extra copy of the model per rank).
        for name, param in model.named_parameters() if params else ():
            if world.rank == 0:
                assert full_sd is not None  # rank 0 passes its full state dict (build_model)
                full = full_sd.pop(name).to(world.device)
            else:
                full = torch.empty(param.shape, dtype=param.dtype, device=world.device)
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
                widen_bf16: bool = False, precision: str = "fp32", compiled: bool = False,
                offload: bool = False, from_checkpoint: bool = False) -> nn.Module:
    """Only rank 0 reads the weights; the other ranks build the model on the meta device and
    receive their shards from rank 0 after sharding. A node's CPU memory then holds one
    full copy of the model, not one per process (8 GPUs × a 70B model in fp32 would not fit).

    ``from_checkpoint`` (a full fine-tune resuming): no rank reads the weights. Rank 0 builds a
    skeleton (load_model), only its buffers are sent, and the checkpoint fills the shards."""
    from . import dist as dist_utils

    model, error = None, None
    try:
        model = load_model(model_cfg, local_path, world.device, weights=world.rank == 0 and not from_checkpoint,
                           precision=precision, sp=world.sp, skeleton=from_checkpoint and world.rank == 0)
        if model_cfg.liger_kernel:
            apply_liger(model)
    except InvalidConfig as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - e.g. a truncated safetensors file: retrying cannot help
        error = f"model.path {model_cfg.path}: cannot load a causal LM ({type(err).__name__}: {err})"
    if world.size > 1:  # every rank fails the same way, not only the one that read the files
        error = next((e for e in dist_utils.all_gather_objects(error) if e), None)
    if error:
        raise InvalidConfig(error)
    assert model is not None  # loaded: a failure set error
    model = apply_lora(model, lora_cfg)
    # Rank 0's weights (LoRA ones included) as full tensors; sharding keeps them alive.
    full_sd = model.state_dict() if world.size > 1 and world.rank == 0 and not from_checkpoint else None
    install_loss_head(model)
    if widen_bf16:
        widen_bf16_gemms(model)
    if compiled:
        compile_layers(model)
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model = shard_model(model, world, precision, offload)
    if world.size > 1:
        load_from_rank0(model, full_sd, world, offload, params=not from_checkpoint)
        del full_sd
    if from_checkpoint:
        log.info("model %s: a full fine-tune resuming, so its weights come from the checkpoint, not %s",
                 model_cfg.path, local_path)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, %.2fM trainable", model_cfg.path, total / 1e6, trainable / 1e6)
    return model


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matmuls (all but input embeddings): the 6·N of MFU."""
    inner = cast("PreTrainedModel", unwrap(model))  # nn.Module's __getattr__ would say Tensor | Module
    emb = inner.get_input_embeddings()
    n_emb = emb.weight.numel() if emb is not None else 0
    total = sum(p.numel() for n, p in inner.named_parameters() if "lora_" not in n)
    head = output_head(inner)
    if head is not None and emb is not None and head.weight is emb.weight:
        return total  # tied: the one table is both a lookup and the LM head's matmul
    return total - n_emb


def attention_dims(model: nn.Module) -> tuple[int, int]:
    """(number of layers, heads × head_dim) for the attention FLOPs term."""
    c = model_config(model)
    heads = getattr(c, "num_attention_heads", 0)
    head_dim = getattr(c, "head_dim", None) or (c.hidden_size // max(heads, 1))
    return c.num_hidden_layers, heads * head_dim
