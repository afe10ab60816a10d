"""Attention selection: the decision table, and the config-time refusal of flash-attention in fp32."""
from __future__ import annotations

import pytest
import torch

from sftjob_trainer import attention
from sftjob_contract.config import ConfigError, build_config
from sftjob_trainer.errors import InvalidConfig

pytestmark = pytest.mark.unit

MINIMAL = {"model": {"path": "m"}, "data": {"train_files": "d.parquet"}, "trainer": {"output_dir": "o"}}


@pytest.mark.parametrize(("requested", "device", "precision", "flash", "want"), [
    # auto: flash-attention exactly for bf16 on CUDA with flash-attn installed
    ("auto", "cuda", "bf16", True, "flash_attention_2"),
    ("auto", "cuda", "fp16", True, "flash_attention_2"),
    ("auto", "cuda", "fp32", True, "sdpa_varlen"),  # the default precision: flash would refuse fp32
    ("auto", "cuda", "bf16", False, "sdpa_varlen"),
    ("auto", "cpu", "bf16", True, "sdpa_varlen"),
    ("auto", "cpu", "fp32", False, "sdpa_varlen"),
    # explicit choices are kept
    ("sdpa", "cuda", "bf16", True, "sdpa"),
    ("eager", "cpu", "fp32", False, "eager"),
    ("flash_attention_2", "cuda", "bf16", True, "flash_attention_2"),
])
def test_attention_decision_table(monkeypatch, requested, device, precision, flash, want):
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash)
    assert attention.pick_attention(requested, torch.device(device), precision) == want


@pytest.mark.parametrize(("device", "flash"), [("cpu", True), ("cuda", False)])
def test_explicit_flash_attention_needs_cuda_and_flash_attn(monkeypatch, device, flash):
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: flash)
    with pytest.raises(InvalidConfig, match=r"model\.attn_implementation=flash_attention_2 needs a CUDA device"):
        attention.pick_attention("flash_attention_2", torch.device(device), "bf16")


def test_explicit_flash_attention_with_fp32_is_refused_at_config_time_naming_both_keys():
    raw = {**MINIMAL, "model": {"path": "m", "attn_implementation": "flash_attention_2"}}
    with pytest.raises(ConfigError,
                       match=r"model\.attn_implementation=flash_attention_2 needs trainer\.precision=bf16"):
        build_config(raw)  # fp32 is the default precision
    ok = build_config({**raw, "trainer": {"output_dir": "o", "precision": "bf16"}})
    assert ok.model.attn_implementation == "flash_attention_2"

