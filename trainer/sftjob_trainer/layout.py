"""The output layout under ``trainer.output_dir`` (docs/trainer-contract.md, "Outputs").

Relative paths, the same for a local directory and an s3:// prefix; the operator reads
the same names, so they are stated once.
"""
from __future__ import annotations

METRICS = "metrics.jsonl"
CACHE = "cache"
HF = "hf"
HF_FINAL = "hf/final"
HF_ADAPTER = "hf/adapter"

CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"  # written last: a checkpoint without it is never resumed from
MANIFEST = "manifest.json"  # every file of the checkpoint and its size
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"  # checkpoints/latest: a pointer for people and tools, never trusted on resume
RANK_REPORTS = "_ranks"  # checkpoints/step-<N>/_ranks/rank-<r>.json: what each rank published


def step_dir(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step}"
