"""Shared helpers for the SFT throughput bench (no trainer logic lives here).

Everything a contender needs to be comparable:
  * the model config and a deterministic random init (seed 0),
  * the dataset location/loader,
  * the MFU formula (see README "MFU"),
  * a tiny timing/token-accounting helper so every contender reports the same way.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = BENCH_DIR.parent / ".bench" / "data"  # .bench/ is git-ignored
MODEL_CONFIG = BENCH_DIR / "model_config.json"
PAD_ID = 0  # never used by a real token (see make_data.py)


def load_model_config_dict() -> dict:
    with open(MODEL_CONFIG) as f:
        return json.load(f)


def build_model(seed: int = 0, attn_implementation: str = "sdpa"):
    """Random-init LlamaForCausalLM from model_config.json; identical weights for every contender."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**load_model_config_dict())
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model


def param_counts(model) -> dict:
    """n_total, n_embed (input embedding lookup, no matmul FLOPs), n_matmul (everything else incl. lm_head)."""
    n_total = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    return {"n_total": n_total, "n_embed": n_embed, "n_matmul": n_total - n_embed}


def model_flops(n_matmul: int, n_real_tokens: int, sum_sq_seq_len: int, cfg: dict | None = None) -> float:
    """Useful training FLOPs (fwd+bwd) for a set of sequences; padding is NOT counted.

    6 * N_matmul * tokens                              (dense matmuls, fwd 2 + bwd 4)
    + 6 * n_layers * (n_heads * head_dim) * sum_i s_i^2  (causal attention scores + AV:
        fwd 2 matmuls * 2 FLOP * s^2/2 (causal half) * d_attn = 2 s^2 d_attn; x3 for fwd+bwd)
    """
    cfg = cfg or load_model_config_dict()
    d_attn = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return 6.0 * n_matmul * n_real_tokens + 6.0 * cfg["num_hidden_layers"] * d_attn * float(sum_sq_seq_len)


def read_peak_gflops(dtype: str = "fp32") -> float | None:
    """Peak of `dtype` from matmul_peak.py (--json, default /tmp/sft_bench_peak.json; override the path
    with $BENCH_PEAK_JSON) or $BENCH_PEAK_GFLOPS. None if neither exists (then no MFU is printed)."""
    if os.environ.get("BENCH_PEAK_GFLOPS"):
        return float(os.environ["BENCH_PEAK_GFLOPS"])
    p = Path(os.environ.get("BENCH_PEAK_JSON", "/tmp/sft_bench_peak.json"))
    if p.exists():
        return json.loads(p.read_text()).get(f"peak_gflops_{dtype}")
    return None


def load_examples(data_dir: Path | str = DEFAULT_DATA_DIR):
    """List of dicts with prompt_ids / response_ids (python lists of int), in file order."""
    import pyarrow.parquet as pq

    t = pq.read_table(Path(data_dir) / "train.parquet", columns=["prompt_ids", "response_ids"])
    return t.to_pylist()


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class StepMeter:
    """Counts real tokens per optimizer step and wall time; timed window = steps > warmup.

    Call `add_micro(n_real_tokens, seq_lens)` for every micro-batch forward, `step_end()` after
    every optimizer step. `seq_lens` are the original (unpacked) sequence lengths in that micro-batch.
    """

    def __init__(self, warmup_steps: int):
        self.warmup = warmup_steps
        self.step = 0
        self._pending_tok = 0
        self._pending_sq = 0
        self._pending_seqs = 0
        self._pending_padded = 0
        self.t_start = None
        self.t_end = None
        self.tokens = 0
        self.sum_sq = 0
        self.seqs = 0
        self.padded_tokens = 0
        self.step_times = []
        self._t_last = time.perf_counter()

    def add_micro(self, n_real: int, seq_lens, n_slots: int):
        self._pending_tok += int(n_real)
        self._pending_sq += int(sum(int(s) ** 2 for s in seq_lens))
        self._pending_seqs += len(seq_lens)
        self._pending_padded += int(n_slots)

    def step_end(self):
        now = time.perf_counter()
        self.step += 1
        self.step_times.append(now - self._t_last)
        self._t_last = now
        if self.step == self.warmup:
            self.t_start = now
        elif self.step > self.warmup:
            self.tokens += self._pending_tok
            self.sum_sq += self._pending_sq
            self.seqs += self._pending_seqs
            self.padded_tokens += self._pending_padded
            self.t_end = now
        self._pending_tok = self._pending_sq = self._pending_seqs = self._pending_padded = 0

    def summary(self, n_matmul: int, dtype: str = "fp32") -> dict:
        if self.warmup == 0:
            raise ValueError("warmup must be >= 1 (timing starts at the end of the last warm-up step)")
        dt = self.t_end - self.t_start
        tps = self.tokens / dt
        flops = model_flops(n_matmul, self.tokens, self.sum_sq)
        peak = read_peak_gflops(dtype)
        out = {
            "timed_steps": self.step - self.warmup,
            "timed_seconds": dt,
            "real_tokens": self.tokens,
            "slot_tokens": self.padded_tokens,
            "pad_fraction": 1.0 - self.tokens / max(1, self.padded_tokens),
            "sequences": self.seqs,
            "tokens_per_s": tps,
            "model_gflops_per_s": flops / dt / 1e9,
            "step_times_s": [round(x, 3) for x in self.step_times],
        }
        if peak:
            out["peak_gflops"] = peak
            out["mfu"] = flops / dt / 1e9 / peak
        return out


def final_line(tokens_per_s: float, loss: float) -> str:
    return f"tokens_per_s={tokens_per_s:.2f} loss={loss:.4f}"
