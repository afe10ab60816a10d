"""The trainer's typed configuration tree.

Part of the contract (see the package docstring): the trainer loads it from YAML plus
dotted overrides, and the operator embeds its JSON schema into the SFTJob CRD and
validates the config it derives from a spec against it.

Every field carries a description because the CRD's descriptions are what
`kubectl explain` shows; defaults live here so that the CRD and the trainer agree.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from .sections import DataConfig, LoraConfig, ModelConfig, OptimConfig, _Section
from .tracking import TrackingConfig

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
    cpu_mkl_dispatch: Literal["instruction_set", "vendor"] = Field(
        default="instruction_set",
        description="How Intel oneMKL (torch's fp32 GEMM on x86 CPUs) picks its kernels on an AMD CPU: "
        "instruction_set (by the CPU's AVX2/FMA or AVX-512, as it does on Intel CPUs; measured 1.2-1.4x faster "
        "products on an AMD EPYC) or vendor (oneMKL's own choice, slower kernels on any CPU not Intel's). "
        "Ignored on GPUs, on other CPUs and when torch's oneMKL is not the build the trainer knows; the trainer "
        "logs which applies.",
    )
    cpu_attention: Literal["auto", "sdpa"] = Field(
        default="auto",
        description="Which kernel runs causal attention over packed fp32 rows on a CPU: auto (sftjob's own, a "
        "causal-half kernel for the whole row on x86-64 CPUs with AVX2 and FMA, shipped prebuilt in the trainer "
        "image; measured 1.85-2.16x torch's CPU flash sdpa on packed rows of 16-512-token sequences) or sdpa "
        "(torch's, one call per sequence). auto keeps sdpa where the kernel cannot run: bf16 or dropout, head_dim "
        "not a multiple of 16, another CPU, no kernel library; the trainer logs which applies. Ignored on GPUs.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (fuses the norms, activations, rotary embedding and casts "
        "around the matmuls; attention stays eager). The first steps pay the compile time. Kernels are built in "
        "the pod: on CPUs it needs a C++ compiler (the project's CPU trainer image has none), on GPUs a C compiler "
        "for Triton; without one the job fails at start with InvalidConfig.",
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
    sequence_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description="Ulysses sequence parallelism: shard each sequence across this many ranks (the ranks form a "
        "data-parallel x sequence-parallel grid; attention exchanges heads with an all-to-all). Must divide the "
        "world size and the model's attention heads. 1: off.",
    )
    cpu_offload: bool = Field(
        default=False,
        description="Keep parameters, gradients and optimizer state in host memory between uses (FSDP2 CPU "
        "offload): fits a model whose states exceed the accelerators' memory, at the cost of host-device copies. "
        "GPU only.",
    )
    fsdp_gather: Literal["auto", "per_layer", "per_step"] = Field(
        default="auto",
        description="How often FSDP gathers the sharded weights and reduces the gradients (2 or more processes). "
        "per_layer: each layer's weights are gathered for its forward and again for its backward, gradients "
        "reduced after every micro-batch (least memory). per_step: the gathered weights and full gradients are "
        "kept from the step's first forward to its last backward (one gather and one reduction per step; costs "
        "the model's weights in the compute dtype plus fp32 gradients per rank). auto: per_step when that fits in "
        "a tenth of a rank's memory (the GPU's; on a CPU its share of the pod's limit), else per_layer. The "
        "trainer logs its choice.",
    )
    early_stopping_patience: int = Field(
        default=0, ge=0,
        description="Stop training (successfully, reason EarlyStopped) after this many validations in a row "
        "without a validation loss lower than the best by more than early_stopping_min_delta. Needs validation "
        "data and test_freq. 0: off.",
    )
    early_stopping_min_delta: float = Field(
        default=0.0, ge=0,
        description="The least drop in validation loss that counts as an improvement for early stopping.",
    )
    export: Literal["last", "best"] = Field(
        default="last",
        description="Which weights become the exported model: the last step's, or those of the checkpoint with "
        "the lowest validation loss (the trainer checkpoints at every validation that sets a new best and keeps "
        "that checkpoint beyond keep_checkpoints until a better one commits; needs validation data and test_freq).",
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
    tracking: TrackingConfig = Field(default_factory=TrackingConfig,
                                     description="Experiment tracking (TensorBoard, MLflow, W&B); all off by default.")

    @model_validator(mode="after")
    def _best_needs_validation(self) -> SFTConfig:
        # Early stopping and the best model are judged on validation loss: without periodic
        # validation there is nothing to judge, and the job would silently do neither.
        t = self.trainer
        for name, on in (("early_stopping_patience", t.early_stopping_patience > 0), ("export", t.export == "best")):
            if on and (not self.data.val_files or t.test_freq == 0):
                raise ValueError(f"trainer.{name} needs periodic validation: set data.val_files and trainer.test_freq")
        return self

    @model_validator(mode="after")
    def _per_step_gather_holds_the_model(self) -> SFTConfig:
        if self.trainer.fsdp_gather == "per_step" and self.trainer.cpu_offload:
            raise ValueError("trainer.fsdp_gather=per_step keeps the whole model on each GPU for the step, which "
                             "trainer.cpu_offload is there to avoid: use fsdp_gather auto or per_layer with it")
        return self

    @model_validator(mode="after")
    def _flash_attention_needs_bf16(self) -> SFTConfig:
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
