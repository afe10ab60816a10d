"""Hugging Face exports that load and serve as they are (sftjob_contract.layout).

``hf/final``: a full model with config, generation config and the tokenizer (with its
chat template); LoRA runs also write ``hf/adapter`` (the PEFT adapter) and, unless
``lora.merge_on_export`` is off, ``hf/final`` is the base model with the adapter merged.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from sftjob_contract import layout

log = logging.getLogger(__name__)


def export(model, tokenizer, out: Path, base_model_path: str, is_lora: bool, merge: bool, rank: int,
           base_model_ref: str | None = None) -> Path | None:
    """Collective (every rank joins the gather); rank 0 writes the exports into ``out``, the
    exports directory (layout.HF): ``final`` and, for LoRA, ``adapter``. Returns the final
    model dir.

    ``base_model_path`` is where the base model lies on this node (maybe a cache of an
    s3:// model); ``base_model_ref`` is what the user named, recorded in the adapter's
    config so that it points at the real base model rather than at a node's cache.
    """
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    if not is_lora:
        final = _fresh(out / layout.FINAL)
        model.save_pretrained(final, state_dict=full_sd, safe_serialization=True)
        tokenizer.save_pretrained(final)
        return final
    adapter = _fresh(out / layout.ADAPTER)
    model.save_pretrained(adapter, state_dict=full_sd, safe_serialization=True)
    tokenizer.save_pretrained(adapter)
    if base_model_ref:
        cfg_path = adapter / "adapter_config.json"
        adapter_cfg = json.loads(cfg_path.read_text())
        adapter_cfg["base_model_name_or_path"] = base_model_ref
        cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    if not merge:
        return adapter
    # Merge on a clean copy of the base so the export never depends on the sharded
    # training module: base weights + saved adapter, exactly what a user would do.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    final = _fresh(out / layout.FINAL)
    merged.save_pretrained(final, safe_serialization=True)
    tokenizer.save_pretrained(final)
    return final


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path
