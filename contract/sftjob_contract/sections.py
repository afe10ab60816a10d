"""The sections of the trainer's config tree that describe the model, the data, the
optimizer and LoRA (config.py holds the run section, the whole tree and its loaders).

Part of the contract: every field carries a description because the CRD's descriptions are
what `kubectl explain` shows; defaults live here so that the CRD and the trainer agree.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["DataConfig", "LoraConfig", "ModelConfig", "OptimConfig"]


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
    liger_kernel: bool = Field(
        default=False,
        description="Patch the model with Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE and a fused linear "
        "cross-entropy that never materializes the logits). GPU only, and only for the architectures Liger supports "
        "(Llama, Mistral, Qwen2/3, Gemma, Phi3, ...); anything else is refused naming this field.",
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
