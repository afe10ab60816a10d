"""The sections of the trainer's config tree that describe the model, the data, the
optimizer and LoRA (config.py holds the run section, the whole tree and its loaders).

Part of the contract: every field carries a description because the CRD's descriptions are
what `kubectl explain` shows; defaults live here so that the CRD and the trainer agree.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["DataConfig", "DataSource", "LoraConfig", "ModelConfig", "OptimConfig", "batch_splits",
           "batch_splits_cel"]

# The global batch's one rule: `data.train_batch_size` sequences split into whole micro-batches of
# `data.micro_batch_size_per_gpu` on each of the data-parallel ranks, the same number on each.
# The config checks it with one rank, the CRD (batch_splits_cel) and the operator (sizes.py) at
# each gang size, the trainer (batching.py) at the world it runs in. Written once, as an
# expression that reads the same in Python and in CEL (integers, % and *).
_BATCH_RULE = "{train} % ({data_parallel} * {micro}) == 0"


def batch_splits(train_batch_size: int, micro_batch_size: int, data_parallel: int = 1) -> bool:
    """Whether the global batch splits into whole micro-batches on ``data_parallel`` ranks."""
    return train_batch_size % (data_parallel * micro_batch_size) == 0


def batch_splits_cel(train: str, micro: str, data_parallel: str) -> str:
    """The same rule as a CEL expression over the given CEL sub-expressions."""
    return _BATCH_RULE.format(train=train, micro=f"({micro})", data_parallel=f"({data_parallel})")


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


# Caps that keep the CRD's per-file CEL rule within the API server's cost budget
# (sources x files per source x the cost of one URI check).
MAX_SOURCES = 16
MAX_FILES_PER_SOURCE = 64
_SOURCE_NAME = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"


class DataSource(_Section):
    """One weighted source of training data (an entry of data.sources)."""

    files: list[str] = Field(
        description="This source's files: local paths, directories, globs or s3:// URIs (as train_files). "
        "A directory contributes the files of this source's format.",
        min_length=1, max_length=MAX_FILES_PER_SOURCE,
    )
    weight: float = Field(
        default=1.0, gt=0,
        description="Relative share of this source in every epoch; the weights of all sources are normalized "
        "to sum to 1 (0.5/0.3/0.2 and 5/3/2 mix the same).",
    )
    name: str | None = Field(
        default=None, pattern=_SOURCE_NAME,
        description="Name in logs, metrics.jsonl and the per-source Prometheus gauges (letters, digits, '_', "
        "'.', '-'). Default: the source's index in data.sources ('0', '1', ...).",
    )
    format: Literal["parquet", "jsonl"] | None = Field(
        default=None,
        description="File format. Unset: from the file names (.jsonl or .jsonl.gz is JSONL, .parquet is parquet); "
        "JSONL holds one JSON object per line.",
    )
    prompt_key: str | None = Field(
        default=None, min_length=1,
        description="This source's prompt column. A source that sets any of prompt_key, response_key and "
        "messages_key defines its columns itself (unset keys: the data section's prompt_key/response_key, "
        "no messages_key); one that sets none uses the data section's three.",
    )
    response_key: str | None = Field(
        default=None, min_length=1, description="This source's response column (see prompt_key)."
    )
    messages_key: str | None = Field(
        default=None, min_length=1,
        description="This source's messages column: set it to mix multi-turn data with single-turn sources "
        "(see prompt_key).",
    )

    _as_list_files = field_validator("files", mode="before")(_as_list)

    def columns(self, data: DataConfig) -> tuple[str, str, str | None]:
        """(prompt_key, response_key, messages_key) of this source, after inheriting from ``data``."""
        if self.prompt_key is None and self.response_key is None and self.messages_key is None:
            return data.prompt_key, data.response_key, data.messages_key
        return (self.prompt_key or data.prompt_key, self.response_key or data.response_key, self.messages_key)


class DataConfig(_Section):
    """Where the SFT data lives and how it is tokenized and batched."""

    train_files: list[str] | None = Field(
        default=None,
        description="Training parquet files: local paths, directories, globs or s3:// URIs. The one-source form "
        "of sources: give exactly one of train_files and sources.",
        min_length=1,
    )
    sources: list[DataSource] | None = Field(
        default=None,
        description="Several weighted training sources (parquet or JSONL, single- or multi-turn) mixed in one "
        "seeded order; each epoch draws from each source its weight's share of all their usable rows "
        "(docs/trainer.md, 'Mixing data sources'). Give exactly one of train_files and sources.",
        min_length=1, max_length=MAX_SOURCES,
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
        description="The size of a forward/backward pass on each rank, in sequences; the per-rank batch "
        "(train_batch_size / world size) must be a multiple of it. With packing and no "
        "max_tokens_per_micro_batch, a micro-batch holds as many whole sequences as fit in this many "
        "max_length sequences' tokens (the memory of that many full-length samples; on a CPU at least "
        "the floor that max_tokens_per_micro_batch states); without packing, "
        "exactly this many sequences, padded to the longest.",
    )
    packing: bool = Field(
        default=True,
        description="Concatenate the sequences of a micro-batch into one padding-free row "
        "(position ids restart per sequence, attention stays block-diagonal): no FLOPs or memory are "
        "spent on padding. false: padded rows, one sequence each (for a model whose attention cannot "
        "take packed rows).",
    )
    shuffle: bool = Field(
        default=True,
        description="Visit samples in a seeded random permutation per epoch (else file order).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        gt=0,
        description="Form micro-batches by tokens instead of by count: the global batch is shared "
        "between ranks by tokens (the same number of samples each, longest first to the rank with the "
        "fewest tokens), and consecutive samples of a rank's share are grouped while their total "
        "length stays within this budget (a longer sample forms a micro-batch alone); every rank "
        "runs as many micro-batches as the rank that needs the most. micro_batch_size_per_gpu is "
        "then not used for training. Unset: micro_batch_size_per_gpu x max_length tokens with "
        "packing (on a CPU at least 786432 / the model's hidden size tokens, e.g. 2048 for a "
        "384-wide model: a CPU pays a fixed cost per micro-batch and runs a narrow model's small "
        "matmuls slowly), micro_batch_size_per_gpu sequences without.",
    )

    _as_list_train = field_validator("train_files", "val_files", mode="before")(_as_list)

    @model_validator(mode="after")
    def _distinct_columns(self) -> DataConfig:
        if self.messages_key is None and self.prompt_key == self.response_key:
            raise ValueError(f"data.prompt_key and data.response_key are both {self.prompt_key!r}: the response "
                             "would be the prompt itself; name two different columns")
        return self

    @model_validator(mode="after")
    def _one_kind_of_train_data(self) -> DataConfig:
        if (self.train_files is None) == (self.sources is None):
            raise ValueError("give exactly one of data.train_files (one source) and data.sources (weighted sources); "
                             + ("both are set" if self.sources is not None else "neither is set"))
        return self

    @model_validator(mode="after")
    def _sources_are_distinct(self) -> DataConfig:
        names = self.source_names()
        for i, source in enumerate(self.sources or []):
            prompt, response, messages = source.columns(self)
            if messages is None and prompt == response:
                raise ValueError(f"data.sources[{i}]: prompt_key and response_key are both {prompt!r}; name two "
                                 "different columns (or set messages_key)")
            if names.count(names[i]) > 1:
                raise ValueError(f"data.sources[{i}].name {names[i]!r} is used by two sources; names must be unique")
        return self

    def source_names(self) -> list[str]:
        """Each source's name: its own, or its index."""
        return [s.name if s.name is not None else str(i) for i, s in enumerate(self.sources or [])]

    def token_budget(self, floor: int = 0) -> int | None:
        """Tokens per training micro-batch (None: micro_batch_size_per_gpu sequences each). With
        packing and no explicit budget, the tokens of micro_batch_size_per_gpu full-length samples:
        the memory a micro-batch of that many sequences may already take, filled with whole
        sequences instead of padding, so short data runs fewer, larger (faster) passes; or
        ``floor`` tokens if that is more (the trainer's floor on a CPU, see its batching.py)."""
        if self.max_tokens_per_micro_batch is not None:
            return self.max_tokens_per_micro_batch
        return max(self.micro_batch_size_per_gpu * self.max_length, floor) if self.packing else None

    @model_validator(mode="after")
    def _micro_divides_global(self) -> DataConfig:
        if not batch_splits(self.train_batch_size, self.micro_batch_size_per_gpu):
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
