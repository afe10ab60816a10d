"""Shared helpers for the SFT throughput bench (no trainer logic lives here).

Everything a contender needs to be comparable:
  * the model config and a deterministic random init (seed 0),
  * the dataset location/loader,
  * the FLOPs of a set of sequences: the trainer's own formula and parameter count
    (sftjob_trainer.metrics.step_flops, sftjob_trainer.model.matmul_params), so every
    contender's MFU is the one the trainer reports (see docs/benchmarks.md, MFU),
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


def add_mkl_dispatch_option(ap, default: str = "instruction_set", who: str = "as our trainer picks them") -> None:
    """``--cpu-mkl-dispatch``: trainer.cpu_mkl_dispatch for a bench tool's own products."""
    ap.add_argument("--cpu-mkl-dispatch", choices=["instruction_set", "vendor"], default=default,
                    help=f"how oneMKL picks its kernels on an AMD CPU (trainer.cpu_mkl_dispatch, "
                    f"sftjob_trainer.cpu_blas); default {default}: {who}")


def pick_mkl_kernels(setting: str) -> None:
    """Apply trainer.cpu_mkl_dispatch in this process as the trainer does, before any product, and
    print the trainer's line saying which kernels oneMKL runs."""
    from sftjob_trainer.cpu_blas import dispatch_by_instruction_set

    print(dispatch_by_instruction_set(setting), flush=True)


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
    """n_total, and n_matmul as the trainer counts it (everything but the input embedding
    lookup; a tied embedding counts once, as the LM head's matmul)."""
    from sftjob_trainer.model import matmul_params

    return {"n_total": sum(p.numel() for p in model.parameters()), "n_matmul": matmul_params(model)}


def training_flops(model, seq_lengths: list[int]) -> float:
    """Useful training FLOPs (fwd+bwd) of these sequences, padding not counted: the trainer's
    step_flops, 6·N_matmul·tokens + 6·n_layers·d_attn·Σ s²."""
    from sftjob_trainer.metrics import step_flops
    from sftjob_trainer.model import attention_dims, matmul_params

    return step_flops(matmul_params(model), *attention_dims(model), seq_lengths)


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
        self._pending_lens: list[int] = []
        self._pending_padded = 0
        self.t_start = None
        self.t_end = None
        self.tokens = 0
        self.seq_lens: list[int] = []
        self.padded_tokens = 0
        self.step_times = []
        self._t_last = time.perf_counter()

    def add_micro(self, n_real: int, seq_lens, n_slots: int):
        self._pending_tok += int(n_real)
        self._pending_lens += [int(s) for s in seq_lens]
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
            self.seq_lens += self._pending_lens
            self.padded_tokens += self._pending_padded
            self.t_end = now
        self._pending_tok = self._pending_padded = 0
        self._pending_lens = []

    def summary(self, model, dtype: str = "fp32") -> dict:
        if self.warmup == 0:
            raise ValueError("warmup must be >= 1 (timing starts at the end of the last warm-up step)")
        dt = self.t_end - self.t_start
        tps = self.tokens / dt
        flops = training_flops(model, self.seq_lens)
        peak = read_peak_gflops(dtype)
        out = {
            "timed_steps": self.step - self.warmup,
            "timed_seconds": dt,
            "real_tokens": self.tokens,
            "slot_tokens": self.padded_tokens,
            "pad_fraction": 1.0 - self.tokens / max(1, self.padded_tokens),
            "sequences": len(self.seq_lens),
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
