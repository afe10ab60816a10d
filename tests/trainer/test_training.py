"""End-to-end trainer runs: real processes, torchrun + gloo for 2 ranks."""
from __future__ import annotations

import shutil

import pytest
import torch

from . import runner

pytestmark = pytest.mark.distributed


def drop(steps: list[dict], k: int = 5) -> float:
    first = sum(r["loss"] for r in steps[:k]) / k
    last = sum(r["loss"] for r in steps[-k:]) / k
    return 1 - last / first


@pytest.mark.parametrize("lora", [0, 16], ids=["full", "lora"])
def test_loss_falls_and_export_reproduces_val_loss(assets, tmp_path, lora):
    out = tmp_path / "out"
    over = {"trainer.total_training_steps": 100, "data.val_files": assets / "data" / "val.parquet",
            "data.micro_batch_size_per_gpu": 8, "lora.rank": lora}
    if lora:
        over |= {"optim.lr": 1e-2, "lora.alpha": 32}
    res = runner.run(runner.base_args(assets, out, **over), out)
    assert res.code == 0, res.why()
    steps = res.steps()
    assert len(steps) == 100 and [r["step"] for r in steps] == list(range(1, 101))
    assert drop(steps) >= 0.40, f"loss fell only {drop(steps):.0%}: {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}"
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in steps)

    # The exported model loads as a user would load it and reproduces the last val_loss.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sftjob_contract.config import DataConfig
    from sftjob_trainer.data import SampleBuilder, SFTDataset
    from sftjob_trainer.batching import eval_batches
    from sftjob_trainer.loss import ce_sum

    final = out / "hf" / "final"
    assert (final / "model.safetensors").exists() and (final / "generation_config.json").exists()
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template, "the exported tokenizer must keep its chat template"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32, attn_implementation="sdpa").eval()
    data_cfg = DataConfig(train_files=[str(assets / "data" / "val.parquet")], max_length=64)
    val = SFTDataset(data_cfg.train_files, SampleBuilder(tok, data_cfg), "val")
    total = count = 0.0
    with torch.no_grad():
        for mb in eval_batches(val, 8, 0, 1, False, tok.pad_token_id):
            total += ce_sum(model, mb, torch.device("cpu"), "fp32").item()
            count += mb.n_targets
    assert abs(total / count - res.vals()[-1]["val_loss"]) < 1e-4
    if lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, out / "hf" / "adapter")
        assert any("lora_" in n for n, _ in adapted.named_parameters())


def test_sigterm_then_rerun_resumes_exactly(assets, tmp_path):
    """2 ranks: SIGTERM mid-way exits 143; the rerun's losses equal the uninterrupted run's."""
    over = {"trainer.total_training_steps": 24, "data.micro_batch_size_per_gpu": 2, "lora.rank": 8,
            "optim.lr_scheduler": "cosine", "lora.dropout": 0.1}
    ref_out, out = tmp_path / "ref", tmp_path / "int"
    ref = runner.run(runner.base_args(assets, ref_out, **over), ref_out, nproc=2)
    assert ref.code == 0, ref.output

    args = runner.base_args(assets, out, **over)
    stopped = runner.run_and_sigterm(args, out, after_steps=9, nproc=2)
    assert stopped.code == 143, stopped.output
    assert "Traceback" not in stopped.output and "torchrun: stopped by signal 15" in stopped.output
    done = [r["step"] for r in stopped.steps()]
    assert 9 <= done[-1] < 24
    assert (out / "checkpoints" / f"step-{done[-1]}" / "COMMITTED").exists()

    resumed = runner.run(args, out, nproc=2)
    assert resumed.code == 0, resumed.output
    assert f"resumed from {out / 'checkpoints' / f'step-{done[-1]}'}" in resumed.output
    assert "train data: reusing the token-length scan" in resumed.output  # no re-tokenizing on restart
    got = {r["step"]: r["loss"] for r in resumed.steps()}  # the file holds both attempts; later wins
    want = {r["step"]: r["loss"] for r in ref.steps()}
    assert sorted(got) == list(range(1, 25))
    assert [got[s] for s in range(1, 25)] == [want[s] for s in range(1, 25)]


def test_accumulation_and_world_size_invariance(assets, tmp_path):
    """Global batch 8 as 1×8, 8×1 and 2 ranks × 4×1 gives the same per-step losses, with FSDP gathering
    the weights once per step (auto's choice for this model: gradients accumulate unreduced over the
    4 micro-batches) and per layer and micro-batch (a large model's way)."""
    runs = {}
    for name, micro, nproc, gather in (("1x8", 8, 1, "auto"), ("8x1", 1, 1, "auto"), ("2proc", 1, 2, "auto"),
                                       ("2proc per layer", 1, 2, "per_layer")):
        out = tmp_path / name.replace(" ", "_")
        res = runner.run(runner.base_args(assets, out, **{"data.micro_batch_size_per_gpu": micro,
                                                          "trainer.total_training_steps": 5,
                                                          "trainer.fsdp_gather": gather}), out, nproc=nproc)
        assert res.code == 0, res.why()
        runs[name] = [r["loss"] for r in res.steps()]
        if nproc == 2:
            said = "per step (auto:" if gather == "auto" else "per layer and micro-batch (trainer.fsdp_gather"
            assert f"FSDP gathers the weights {said}" in res.output, res.why()
    assert len(runs["1x8"]) == 5
    for name in ("8x1", "2proc", "2proc per layer"):
        assert max(abs(a - b) for a, b in zip(runs["1x8"], runs[name])) < 1e-5, (name, runs)


@pytest.mark.parametrize(
    "over, reason, needle",
    [
        ({"data.prompt_key": "question"}, "InvalidData", "missing column(s) question"),
        ({"optim.lr": "fast"}, "InvalidConfig", "optim.lr"),
        ({"optim.warmup": 3}, "InvalidConfig", "optim.warmup: unknown key"),
        ({"data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 3}, "InvalidConfig", "must divide"),
        ({"data.max_length": 4, "data.truncation": "right"}, "InvalidData", "no trainable tokens"),
        ({"model.path": "/nonexistent/model"}, "InvalidConfig", "model.path /nonexistent/model"),
    ],
    ids=["missing-column", "wrong-type", "unknown-key", "micro-batch", "no-trainable-tokens", "bad-model"],
)
def test_bad_inputs_exit_2_with_reason(assets, tmp_path, over, reason, needle):
    out = tmp_path / "out"
    tlog = tmp_path / "termination-log"
    import subprocess
    import sys

    env = runner.env() | {"SFTJOB_TERMINATION_LOG": str(tlog)}
    proc = subprocess.run([sys.executable, "-m", "sftjob_trainer", *runner.base_args(assets, out, **over)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = tlog.read_text().strip()
    assert line.startswith(reason + ":") and needle in line and "\n" not in line
    assert proc.stderr.strip().splitlines()[-1] == line
    assert not (out / "checkpoints").exists()


def test_empty_file_and_wrong_type_under_torchrun(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    schema = pa.schema([("prompt", pa.string()), ("response", pa.string())])
    pq.write_table(pa.Table.from_pylist([], schema=schema), empty)
    out = tmp_path / "out"
    res = runner.run(runner.base_args(assets, out, **{"data.train_files": empty}), out, nproc=2)
    assert res.code == 2 and "has no rows" in res.output
    # torchrun's per-rank summary says "error_file: <N/A>"; the launcher's last line says why.
    assert res.output.rstrip().splitlines()[-1].startswith("sftjob launch: the first failure: InvalidData: "), \
        res.output[-1000:]

    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": 1, "response": "a"}] * 8), typed)
    res = runner.run(runner.base_args(assets, out, **{"data.train_files": typed}), out, nproc=2)
    assert res.code == 2 and "must hold strings" in res.output

    # Truncated weights: only rank 0 reads them, yet every rank fails with the reason.
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(assets / "model", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    res = runner.run(runner.base_args(assets, out, **{"model.path": broken}), out, nproc=2, timeout=300)
    assert res.code == 2 and "cannot load a causal LM" in res.output, res.output


def test_validation_with_fewer_rows_than_ranks(assets, tmp_path):
    """One validation row and 2 ranks: the idle rank joins every FSDP forward (no hang) and
    the loss is the single row's, the same as one process computes."""
    import pyarrow.parquet as pq

    val = tmp_path / "one.parquet"
    pq.write_table(pq.read_table(assets / "data" / "val.parquet").slice(0, 1), val)
    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"p{nproc}"
        args = runner.base_args(assets, out, **{"data.val_files": val, "trainer.total_training_steps": 2,
                                                "data.micro_batch_size_per_gpu": 2})
        res = runner.run(args, out, nproc=nproc, timeout=300)
        assert res.code == 0, res.why()
        losses[nproc] = [r["val_loss"] for r in res.vals()]
    assert losses[1] and len(losses[1]) == len(losses[2])
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2])) < 1e-4, losses


def test_tied_qwen2_with_dynamic_rope_trains_the_same_on_2_ranks(assets, tmp_path):
    """Rank 0 alone reads the weights; rank 1 builds on the meta device and receives its
    shards and buffers. A tied-embedding Qwen2 with dynamic RoPE must give the same per-step
    losses as one process (without the buffer broadcast, rank 1's rotary frequencies are
    uninitialised memory and the losses come out NaN)."""
    import shutil

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(assets / "model")
    model_dir = tmp_path / "qwen2"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.1,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    for f in (assets / "model").iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, model_dir / f.name)
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"p{nproc}"
        args = runner.base_args(assets, out, **{"model.path": model_dir, "trainer.total_training_steps": 4,
                                                "data.micro_batch_size_per_gpu": 2})
        res = runner.run(args, out, nproc=nproc)
        assert res.code == 0, res.why()
        runs[nproc] = [r["loss"] for r in res.steps()]
    assert len(runs[1]) == 4
    assert max(abs(a - b) for a, b in zip(runs[1], runs[2])) < 1e-5, runs


def test_bf16_checkpointed_run_killed_resumes_exactly_from_its_time_based_checkpoint(assets, tmp_path):
    """2 ranks, bf16 (FSDP2 mixed precision) with activation checkpointing, save_freq=0 and a
    tiny save_interval_s: the run leaves committed checkpoints on its own; SIGKILLed (no stop
    checkpoint), it resumes from the newest and the rerun's losses equal the uninterrupted run's.
    A full fine-tune resumes without the base model's weights (issue 23 item 9): they are
    deleted before the rerun, which takes every parameter from the checkpoint."""
    over = {"trainer.total_training_steps": 40, "data.micro_batch_size_per_gpu": 2, "trainer.precision": "bf16",
            "trainer.cpu_bf16_gemm": "widened", "model.gradient_checkpointing": "true", "trainer.save_freq": 0}
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    ref = runner.run(runner.base_args(assets, ref_out, **over, **{"trainer.save_interval_s": 0}), ref_out, nproc=2)
    assert ref.code == 0, ref.output
    assert sorted(p.name for p in (ref_out / "checkpoints").glob("step-*")) == ["step-40"]  # interval off: final only

    base = tmp_path / "base"
    shutil.copytree(assets / "model", base)
    args = runner.base_args(assets, out, **over, **{"trainer.save_interval_s": 0.001, "trainer.keep_checkpoints": 50,
                                                    "model.path": base})
    killed = runner.run_and_kill(args, out, after_steps=5, nproc=2)
    assert killed.code != 0
    committed = sorted(int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/COMMITTED"))
    assert len(committed) >= 3 and committed[-1] < 40, committed  # one after every step (each takes > 1 ms)

    (base / "model.safetensors").unlink()
    resumed = runner.run(args, out, nproc=2)
    assert resumed.code == 0, resumed.output
    assert "its weights come from the checkpoint" in resumed.output
    newest = committed[-1]
    assert f"resumed from {out / 'checkpoints' / f'step-{newest}'}" in resumed.output, resumed.output
    got = {r["step"]: r["loss"] for r in resumed.steps()}  # the file holds both attempts; later wins
    want = {r["step"]: r["loss"] for r in ref.steps()}
    assert sorted(got) == list(range(1, 41))
    assert [got[s] for s in range(1, 41)] == [want[s] for s in range(1, 41)]
    assert want[40] < want[1]


@pytest.mark.slow
def test_compiled_layers_train_packed_under_fsdp2_and_resume_exactly(assets, tmp_path):
    """trainer.compile on 2 ranks with packed rows (per-sequence attention, left eager) and the
    chunked loss head: inductor really compiles (its cache fills), the losses follow the eager
    run's, and a SIGTERMed compiled run resumes to the uninterrupted compiled run's losses exactly."""
    over = {"trainer.total_training_steps": 8, "data.micro_batch_size_per_gpu": 2, "data.packing": "true",
            "trainer.log_freq": 1}
    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    eager_out, ref_out, out = tmp_path / "eager", tmp_path / "ref", tmp_path / "int"
    eager = runner.run(runner.base_args(assets, eager_out, **over), eager_out, nproc=2)
    assert eager.code == 0, eager.output
    assert not cache.exists()
    compiled = {**over, "trainer.compile": "true"}
    ref = runner.run(runner.base_args(assets, ref_out, **compiled), ref_out, nproc=2, extra_env=env)
    assert ref.code == 0, ref.output
    assert list(cache.rglob("*.py")), "inductor generated no kernels: nothing was compiled"
    want = [r["loss"] for r in ref.steps()]
    assert max(abs(a - b["loss"]) / b["loss"] for a, b in zip(want, eager.steps())) < 1e-4, (want, eager.steps())

    args = runner.base_args(assets, out, **compiled)
    stopped = runner.run_and_sigterm(args, out, after_steps=3, nproc=2, extra_env=env)
    assert stopped.code == 143, stopped.output
    resumed = runner.run(args, out, nproc=2, extra_env=env)
    assert resumed.code == 0 and "resumed from" in resumed.output, resumed.output
    got = {r["step"]: r["loss"] for r in resumed.steps()}
    assert [got[s] for s in range(1, 9)] == want
