"""The files a run writes under `trainer.output_dir` (a local path or an s3:// prefix).

The same relative paths on both kinds of storage; the operator derives status URIs
(`status.output.uri`, `status.checkpointsUri`) from them without reading the store.
"""
from __future__ import annotations

import re

METRICS_FILE = "metrics.jsonl"   # one JSON object per optimizer step and per validation
CHECKPOINTS = "checkpoints"      # holds step-<N>/ directories
COMMITTED = "COMMITTED"          # written last into a step directory: only then it counts
MANIFEST = "manifest.json"       # every file of a checkpoint and its size, written before COMMITTED
CACHE = "cache"                  # derived files (the data scan), safe to delete
OWNER = "owner.json"             # the attempt that may commit, prune and export (trainer fence.py)
TRAINER_STATE = "trainer_state.json"  # in a step directory: step, epoch, data cursor, RNG
RANK_REPORTS = "_ranks"          # in a step directory: what each rank published (rank-<r>.json)
LATEST = "latest"                # checkpoints/latest: the newest committed step, for people and
                                 # tools; never trusted on resume (COMMITTED is)
HF = "hf"                        # the exports
FINAL = "final"                  # under HF: a full Hugging Face model (LoRA: merged into the base)
ADAPTER = "adapter"              # under HF, LoRA runs: the PEFT adapter
HF_FINAL = f"{HF}/{FINAL}"
HF_ADAPTER = f"{HF}/{ADAPTER}"

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(step: int) -> str:
    """The name of one checkpoint's directory under CHECKPOINTS."""
    return f"step-{step}"


def checkpoint_dir(step: int) -> str:
    """One checkpoint's directory relative to the output root: checkpoints/step-<N>."""
    return f"{CHECKPOINTS}/{step_dir(step)}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint directory's name; None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def exported_model(lora: bool, merge_lora: bool) -> str:
    """Where the run's model lands: HF_FINAL, or for a LoRA run exported without merging
    the adapter in HF_ADAPTER, the only model such a run writes."""
    return HF_ADAPTER if lora and not merge_lora else HF_FINAL
