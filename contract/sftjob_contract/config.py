"""The trainer's typed configuration tree.

Part of the contract (see the package docstring): the trainer loads it from YAML plus
dotted overrides, and the operator embeds its JSON schema into the SFTJob CRD and
validates the config it derives from a spec against it.

Every field carries a description because the CRD's descriptions are what
`kubectl explain` shows; defaults live here so that the CRD and the trainer agree.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "SFTConfig",
    "TrainerConfig",
    "load_config",
    "parse_overrides",
]


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key."""


class _Section(BaseModel):
    # Unknown keys are errors (a typo must never be silently ignored) and a built config
    # is never mutated: components receive it and only read.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# An AdamW moment decay: 1 or more never forgets (and diverges), below 0 is meaningless.
_Beta = Annotated[float, Field(ge=0, lt=1)]


def _as_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value] if value else []
    return value


class ModelConfig(_Section):
    """Which Hugging Face causal LM to fine-tune and how to build it."""

    path: str = Field(
        description="Base model: a local directory or an s3:// prefix holding a Hugging Face "
        "model (config.json, safetensors weights, tokenizer). Loaded with "
        "AutoModelForCausalLM.from_pretrained.",
        min_length=1,
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        default="auto",
        description="Attention kernel. 'auto' picks flash_attention_2 for bf16 training on a GPU when the "
        "flash-attn package is importable, else sdpa run once per sequence of a packed row "
        "(padded batches use plain sdpa). flash_attention_2 needs trainer.precision bf16 and a GPU.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward pass (only the layer "
        "inputs are kept): less activation memory for about one more forward pass of compute.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model code shipped with the checkpoint to run. Off by default.",
    )


class DataConfig(_Section):
    """Where the SFT data lives and how it is tokenized and batched."""

    train_files: list[str] = Field(
        description="Training parquet files: local paths, directories, globs or s3:// URIs.",
        min_length=1,
    )
    val_files: list[str] = Field(
        default_factory=list,
        description="Validation parquet files (same forms as train_files). Empty: no validation.",
    )
    prompt_key: str = Field(
        default="prompt", min_length=1, description="Column holding the prompt text (single-turn data)."
    )
    response_key: str = Field(
        default="response", min_length=1,
        description="Column holding the response text (single-turn data); must differ from prompt_key.",
    )
    messages_key: str | None = Field(
        default=None,
        description="Column holding a list of {role, content} messages (multi-turn data). When "
        "set, rows are rendered with the tokenizer's chat template and loss is taken on "
        "assistant turns only; prompt_key/response_key are then ignored.",
    )
    max_length: int = Field(default=1024, gt=1, description="Maximum tokens per sample.")
    truncation: Literal["error", "left", "right"] = Field(
        default="error",
        description="What to do with samples longer than max_length: 'error' fails the job, "
        "'left' drops tokens from the start, 'right' drops tokens from the end.",
    )
    train_batch_size: int = Field(
        default=8, gt=0, description="Global batch size in sequences per optimizer step, across all ranks."
    )
    micro_batch_size_per_gpu: int = Field(
        default=1,
        gt=0,
        description="Sequences per forward/backward pass on each rank; the per-rank batch "
        "(train_batch_size / world size) must be a multiple of it.",
    )
    packing: bool = Field(
        default=False,
        description="Concatenate the sequences of a micro-batch into one padding-free row "
        "(position ids restart per sequence, attention stays block-diagonal).",
    )
    shuffle: bool = Field(
        default=True,
        description="Visit samples in a seeded random permutation per epoch (else file order).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        gt=0,
        description="Form micro-batches by tokens instead of by count: consecutive samples of a "
        "rank's share of the global batch are grouped while their total length stays within this "
        "budget (a longer sample forms a micro-batch alone), and every rank runs as many micro-batches "
        "as the rank that needs the most. micro_batch_size_per_gpu is then not used for training. "
        "Unset: micro_batch_size_per_gpu sequences per micro-batch.",
    )

    _as_list_train = field_validator("train_files", "val_files", mode="before")(_as_list)

    @model_validator(mode="after")
    def _distinct_columns(self) -> "DataConfig":
        if self.messages_key is None and self.prompt_key == self.response_key:
            raise ValueError(f"data.prompt_key and data.response_key are both {self.prompt_key!r}: the response "
                             "would be the prompt itself; name two different columns")
        return self

    @model_validator(mode="after")
    def _micro_divides_global(self) -> "DataConfig":
        if self.train_batch_size % self.micro_batch_size_per_gpu:
            raise ValueError(
                f"data.micro_batch_size_per_gpu ({self.micro_batch_size_per_gpu}) must divide "
                f"data.train_batch_size ({self.train_batch_size})"
            )
        return self


class OptimConfig(_Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(default=1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[_Beta, _Beta] = Field(default=(0.9, 0.95), description="AdamW beta1, beta2, each in [0, 1).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    clip_grad: float = Field(
        default=1.0, ge=0, description="Clip the global gradient norm to this value (0 disables clipping)."
    )
    lr_scheduler: Literal["cosine", "wsd", "constant"] = Field(
        default="cosine",
        description="Schedule after warm-up: cosine decay, warmup-stable-decay, or constant.",
    )
    lr_warmup_steps_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Share of the total steps spent in linear warm-up."
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Floor of the decayed learning rate, as a share of lr."
    )
    wsd_decay_ratio: float = Field(
        default=0.1, ge=0, le=1, description="wsd only: share of the total steps spent in the final decay."
    )


class LoraConfig(_Section):
    """LoRA adapters (peft). rank 0 means a full fine-tune."""

    rank: int = Field(default=0, ge=0, description="LoRA rank; 0 trains all weights instead.")
    alpha: int = Field(default=16, gt=0, description="LoRA scaling numerator (scale = alpha / rank).")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Module names to adapt, or ['all-linear'] for every linear layer but the LM head.",
        min_length=1,
    )
    merge_on_export: bool = Field(
        default=True, description="Also export a full model with the adapter merged into the base weights."
    )

    _as_list_targets = field_validator("target_modules", mode="before")(_as_list)


class TrainerConfig(_Section):
    """Run length, checkpoints, validation, precision and where outputs go."""

    total_epochs: int = Field(default=1, gt=0, description="Passes over the training data.")
    total_training_steps: int | None = Field(
        default=None,
        gt=0,
        description="Stop after this many optimizer steps (default: total_epochs worth of steps).",
    )
    save_freq: int = Field(
        default=0,
        ge=0,
        description="Checkpoint every N optimizer steps (0: only on SIGTERM and by save_interval_s). The end of "
        "training always exports the final model.",
    )
    save_interval_s: float = Field(
        default=1800.0,
        ge=0,
        description="Also checkpoint after the first step that ends once this many seconds have passed since the "
        "last committed checkpoint (or the start of training), so a crash, SIGKILL or lost node loses at most "
        "about this much training. 0 disables.",
    )
    keep_checkpoints: int = Field(
        default=2, gt=0, description="Committed checkpoints to keep; older ones are pruned after a new one commits."
    )
    test_freq: int = Field(
        default=0, ge=0, description="Validate every N optimizer steps (0: only at the end)."
    )
    seed: int = Field(default=42, ge=0, description="Seed for model init of new weights, data order and dropout.")
    output_dir: str = Field(
        description="Where checkpoints, metrics.jsonl and the exported model (hf/final) go: a local path or s3:// URI.",
        min_length=1,
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="Compute precision: bf16 autocast keeps fp32 master weights and optimizer state.",
    )
    cpu_bf16_gemm: Literal["auto", "native", "widened"] = Field(
        default="auto",
        description="How bf16 matrix products run on a CPU: native (oneDNN bf16 GEMM), widened (bf16 operands "
        "converted exactly to fp32, fp32 GEMM, result rounded to bf16: the same arithmetic at fp32 GEMM speed), "
        "auto (widened on CPUs without AVX512-BF16/AMX, where native bf16 is emulated and several times slower). "
        "Ignored on GPUs and with precision fp32.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (fuses the norms, activations, rotary embedding and casts "
        "around the matmuls; attention stays eager). The first steps pay the compile time.",
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port on rank 0 (0: off).",
    )
    log_freq: int = Field(default=1, gt=0, description="Log a progress line every N steps.")
    peak_tflops: float | None = Field(
        default=None,
        gt=0,
        description="Peak dense TFLOP/s of one accelerator (or CPU) at the compute precision, "
        "used to report MFU. Unset: MFU is not reported.",
    )
    log_sample_ids: bool = Field(
        default=False,
        description="Write the ids (row numbers) of every step's samples to metrics.jsonl, to audit the data order.",
    )
    max_failed_commits: int = Field(
        default=3,
        gt=0,
        description="End the run (reason CheckpointFailed, exit 1) once this many checkpoint commits in a row have "
        "failed for a cause that may pass (a slow or failing store); a commit that succeeds resets the count. A "
        "cause that cannot pass (the store denies the writes, no such bucket, a full disk) ends the run at the first "
        "failed commit.",
    )
    max_non_finite_steps: int = Field(
        default=5,
        ge=0,
        description="End the run (reason NonFiniteLoss, exit 2) once this many optimizer steps in a row had a "
        "non-finite loss or gradient norm; such a step is skipped (no update). 0: no limit in a row, but a run in "
        "which no step at all was finite still fails, and nothing is exported.",
    )
    upload_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Deadline for one checkpoint or export upload to s3://, retries included; past it the "
        "checkpoint is not committed and the error is logged (fatal for the final checkpoint).",
    )
    stop_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Budget from SIGTERM to exit; must fit the pod's terminationGracePeriodSeconds. A stop "
        "checkpoint that cannot commit within it is abandoned (never resumed from) and the trainer still exits 143.",
    )


class SFTConfig(_Section):
    """The whole trainer configuration."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    trainer: TrainerConfig

    @model_validator(mode="after")
    def _flash_attention_needs_bf16(self) -> "SFTConfig":
        # flash-attention refuses fp32 inputs: fail here, not at the first forward on the GPU.
        if self.model.attn_implementation == "flash_attention_2" and self.trainer.precision == "fp32":
            raise ValueError("model.attn_implementation=flash_attention_2 needs trainer.precision=bf16 "
                             "(flash-attention does not run in fp32); use attn_implementation auto or sdpa, "
                             "or trainer.precision bf16")
        return self


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key")
        elif e["type"] == "missing":
            parts.append(f"{loc}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg} (got {e.get('input')!r})")
    return "invalid config: " + "; ".join(parts)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn verl-style ``section.key=value`` arguments into a nested dict.

    Values are parsed as YAML scalars/flow collections, so ``lr=1e-5`` is a float,
    ``packing=true`` a bool and ``train_files=[a.parquet,b.parquet]`` a list.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        # YAML scalars: "true" is a bool, "[a,b]" a list. "1e-5" stays a string under
        # YAML 1.1, which pydantic's lax mode still turns into the float it is.
        value = yaml.safe_load(raw) if raw != "" else ""
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def build_config(raw: dict[str, Any]) -> SFTConfig:
    """Validate a plain dict into an SFTConfig, raising ConfigError with key names."""
    try:
        return SFTConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> SFTConfig:
    """Load a YAML config file (optional) and apply dotted overrides on top."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        raw = loaded
    raw = _merge(raw, parse_overrides(overrides or []))
    return build_config(raw)
