"""Ulysses sequence parallelism (trainer.sequence_parallel_size): slices, attention, training, resume.

Tolerance. Every comparison is fp32 against the same computation without SP. What SP changes
is only the order of additions: the CE is summed per slice and then over ranks, FSDP's
reduce-scatter adds 2 or 4 partial gradients instead of 1, and GEMMs run over fewer rows
(another blocking). Each of those moves a result by a few fp32 ulps (~1e-7 relative; measured
up to 1e-6 for the gradients of a whole model); six Adam steps at lr 3e-3 amplify that a little.
So losses must agree to 1e-5 relative and gradient norms to 1e-4, while an error in the
feature (a slice that attends only to itself, ranks of a group reading different samples, a
gradient exchanged the wrong way) moves them by 1e-2 or more (seen while building it).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sftjob_trainer import ulysses
from sftjob_trainer.batching import collate
from sftjob_trainer.data import IGNORE, Sample
from sftjob_trainer.dist import World
from sftjob_trainer.errors import InvalidConfig

from .runner import base_args, env, read_metrics, run, run_and_sigterm

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
STEPS = 6
WORKER = Path(__file__).with_name("ulysses_worker.py")


def samples(lengths: list[int]) -> list[Sample]:
    out = []
    for k, n in enumerate(lengths):
        ids = [10 + k * 10 + i for i in range(n)]
        out.append(Sample(ids, [IGNORE] * 2 + ids[3:] + [IGNORE]))  # a 2-token prompt, shifted targets
    return out


# --------------------------------------------------------------------------- slicing (unit)


@pytest.mark.unit
def test_packed_row_slices_carry_the_full_rows_positions_and_boundaries():
    mb = collate(samples([5, 7, 5]), [0, 1, 2], packing=True, pad_id=0)
    parts = [ulysses.shard_micro_batch(mb, r, 4, pad_id=0) for r in range(4)]
    assert [p.input_ids.shape[1] for p in parts] == [5] * 4  # 17 tokens padded to 20, 5 per rank
    assert torch.equal(torch.cat([p.input_ids for p in parts], 1)[:, :17], mb.input_ids)
    assert torch.cat([p.position_ids for p in parts], 1).tolist() == [[*range(5), *range(7), *range(5), *range(3)]]
    assert all(p.cu_seq_lens.tolist() == [0, 5, 12, 17, 20] for p in parts)  # the padding: a sequence of its own
    assert torch.equal(torch.cat([p.targets for p in parts], 1)[:, 17:], torch.full((1, 3), IGNORE))
    assert sum(p.n_targets for p in parts) == mb.n_targets and sum(p.n_tokens for p in parts) == mb.n_tokens
    assert parts[0].sample_ids == [0, 1, 2] and all(p.sample_ids == [] and p.seq_lengths == [] for p in parts[1:])


@pytest.mark.unit
def test_padded_rows_drop_the_mask_and_count_only_real_tokens():
    mb = collate(samples([6, 3]), [4, 5], packing=False, pad_id=0)
    parts = [ulysses.shard_micro_batch(mb, r, 4, pad_id=0) for r in range(4)]
    assert all(p.attention_mask is None and p.cu_seq_lens is None and p.input_ids.shape == (2, 2) for p in parts)
    assert torch.cat([p.position_ids for p in parts], 1).tolist() == [list(range(8))] * 2
    assert sum(p.n_tokens for p in parts) == 9 and sum(p.n_targets for p in parts) == mb.n_targets


@pytest.mark.unit
def test_sp_that_does_not_divide_the_world_or_the_heads_is_refused():
    with pytest.raises(InvalidConfig,
                       match=r"trainer.sequence_parallel_size=2 must divide the number of processes \(3\)"):
        ulysses.setup(World(0, 0, 3, torch.device("cpu")), 2)
    with pytest.raises(InvalidConfig, match=r"sequence_parallel_size=4 must divide .*num_attention_heads \(6\)"):
        ulysses.check_heads(SimpleNamespace(num_attention_heads=6, num_key_value_heads=6), 4)
    with pytest.raises(InvalidConfig, match=r"sequence_parallel_size=2 and the model's num_key_value_heads \(3\)"):
        ulysses.check_heads(SimpleNamespace(num_attention_heads=6, num_key_value_heads=3), 2)
    ulysses.check_heads(SimpleNamespace(num_attention_heads=8, num_key_value_heads=2), 4)  # kv heads repeated


# --------------------------------------------------------------------------- attention (torchrun)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [4])
def test_sliced_attention_gives_the_whole_rows_loss_and_gradients(assets, nproc):
    """Every kernel (sdpa_varlen, sdpa, eager), on 4 ranks: the tiny model's 2 kv heads are repeated
    (2 ranks, kv heads split, are covered by the training tests)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           str(assets / "model")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    for inner, diff in json.loads(line[len("RESULT "):]).items():
        assert diff["loss"] < LOSS_RTOL and diff["grad"] < GRAD_RTOL, (inner, diff)


# --------------------------------------------------------------------------- training (torchrun)


def steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}  # a rerun's rows come later and win


def assert_same_run(got: dict[int, dict], want: dict[int, dict], first: int = 1) -> None:
    assert sorted(got) == list(range(first, STEPS + 1)), sorted(got)
    for s in got:
        assert got[s]["tokens"] == want[s]["tokens"], s  # the same samples, each counted once
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=LOSS_RTOL), (s, got[s]["loss"], want[s]["loss"])
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=GRAD_RTOL), s


PACKED = {"data.packing": "true", "trainer.total_training_steps": STEPS}
LORA_UNPACKED = {"data.packing": "false", "lora.rank": 8, "lora.alpha": 16, "trainer.total_training_steps": STEPS}


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> dict[str, dict[int, dict]]:
    """The non-SP runs (one process) that the SP runs must reproduce."""
    out = {}
    for name, over in (("packed", PACKED), ("lora", LORA_UNPACKED)):
        d = tmp_path_factory.mktemp(f"ref-{name}")
        res = run(base_args(assets, d, **over), d)
        assert res.code == 0, res.why()
        out[name] = steps(d)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,sp", [(2, 2), (4, 4)], ids=["sp2-of-2", "sp4-of-4"])
def test_packed_full_tuning_with_sp_equals_the_run_without(assets, tmp_path, reference, nproc, sp):
    res = run(base_args(assets, tmp_path, **PACKED, **{"trainer.sequence_parallel_size": sp}), tmp_path, nproc=nproc)
    assert res.code == 0, res.why()
    assert_same_run(steps(tmp_path), reference["packed"])


@pytest.mark.distributed
def test_lora_on_padded_rows_with_2_sp_groups_of_2_equals_the_run_without(assets, tmp_path, reference):
    """4 ranks as dp 2 x sp 2: each SP group reads half of every global batch."""
    res = run(base_args(assets, tmp_path, **LORA_UNPACKED, **{"trainer.sequence_parallel_size": 2}), tmp_path,
              nproc=4)
    assert res.code == 0, res.why()
    assert_same_run(steps(tmp_path), reference["lora"])


@pytest.mark.distributed
def test_a_checkpoint_taken_with_sp_resumes_without_sp_as_if_never_stopped(assets, tmp_path, reference):
    """Stopped (SIGTERM, stop checkpoint) at sp=2 on 2 ranks, resumed at sp=1 on the same 2 ranks."""
    args = base_args(assets, tmp_path, **PACKED, **{"trainer.sequence_parallel_size": 2})
    first = run_and_sigterm(args, tmp_path, after_steps=2, nproc=2, timeout=300)
    assert first.code == 143, first.output[-3000:]
    stopped = max(steps(tmp_path))
    assert stopped < STEPS
    again = run(base_args(assets, tmp_path, **PACKED), tmp_path, nproc=2)
    assert again.code == 0 and f"step-{stopped}" in again.output, again.output[-3000:]
    assert_same_run(steps(tmp_path), reference["packed"])


@pytest.mark.distributed
def test_sp_that_does_not_divide_the_world_exits_2_naming_the_field(assets, tmp_path):
    res = run(base_args(assets, tmp_path, **{"trainer.sequence_parallel_size": 2}), tmp_path)
    assert res.code == 2 and "trainer.sequence_parallel_size=2 must divide the number of processes (1)" in res.output, \
        res.why()
