"""Throughput features keep the numbers exact: chunked loss, varlen attention, token budgets."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sftjob_contract.config import DataConfig, LoraConfig, ModelConfig
from sftjob_trainer.data import IGNORE, SampleBuilder, SFTDataset
from sftjob_trainer.cpu_attention import why_not as why_not_attention
from sftjob_trainer.cpu_blas import read_cpu, why_not
from sftjob_trainer.batching import GlobalBatches, collate, logged_ids, rank_shares, split_to, token_groups

from . import runner


@pytest.fixture(scope="module")
def tok(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "model")


@pytest.mark.unit
def test_chunked_linear_ce_matches_full_logits(monkeypatch):
    import sftjob_trainer.loss as loss

    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 64 * 500)  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 24, generator=g, requires_grad=True)
    weight = torch.randn(500, 24, generator=g, requires_grad=True)
    targets = torch.randint(0, 500, (300,), generator=g)
    targets[::5] = IGNORE
    got = loss.linear_ce_sum(hidden, weight, targets)
    (got * 0.5).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE, reduction="sum")
    (want * 0.5).backward()
    assert torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(gh, hidden.grad, atol=1e-5) and torch.allclose(gw, weight.grad, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(loss.linear_ce_sum(hidden, weight, targets), want, rtol=1e-6)


@pytest.mark.unit
def test_loss_head_gradients_are_written_once_and_handed_on():
    """The head's weight gradient is the first chunk's product, scaled in place in backward:
    no zero-filled or scaled copy of a vocab x hidden tensor per micro-batch; two micro-batches
    still accumulate; a second backward through one graph is refused, not scaled twice."""
    import sftjob_trainer.loss as loss
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 24, generator=g, requires_grad=True)
    weight = torch.randn(500, 24, generator=g, requires_grad=True)
    targets = torch.randint(0, 500, (40,), generator=g)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (loss.linear_ce_sum(hidden, weight, targets) * 0.25).backward()
    copies = ("aten::zero_", "aten::fill_", "aten::mul", "aten::clone", "aten::copy_")
    whole = [e.name for e in prof.events()
             if e.name in copies and e.input_shapes and list(e.input_shapes[0]) == [500, 24]]
    assert whole == [], whole
    first = weight.grad.clone()
    (loss.linear_ce_sum(hidden, weight, targets) * 0.25).backward()
    assert torch.allclose(weight.grad, 2 * first)
    want = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), targets, reduction="sum") * 0.25, weight)[0]
    assert torch.allclose(first, want, atol=1e-5)

    ce = loss.linear_ce_sum(hidden, weight, targets)
    ce.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        ce.backward()

    weight.grad = None
    nothing = torch.full((40,), IGNORE)
    loss.linear_ce_sum(hidden, weight, nothing).backward()
    assert weight.grad.shape == weight.shape and not weight.grad.any()


def _model(assets, attn: str):
    from sftjob_trainer.dist import World
    from sftjob_trainer.model import build_model

    path = str(assets / "model")
    return build_model(ModelConfig(path=path, attn_implementation=attn), LoraConfig(), path,
                       World(0, 0, 1, torch.device("cpu")))


@pytest.mark.unit
def test_packed_varlen_loss_head_equals_padded_stock_model(assets, tok):
    """Our model (per-sequence sdpa, loss head) on a packed row = stock sdpa on padded rows, grads too."""
    from transformers import AutoModelForCausalLM

    from sftjob_trainer.loss import ce_sum
    from sftjob_trainer.loss import LossHead

    f = str(assets / "data" / "chat_train.parquet")
    ds = SFTDataset([f], SampleBuilder(tok, DataConfig(train_files=[f], messages_key="messages", max_length=128)), "t")
    ids = [0, 1, 2, 3, 4]
    samples = [ds.sample(i) for i in ids]
    padded = collate(samples, ids, packing=False, pad_id=tok.pad_token_id)
    packed = collate(samples, ids, packing=True, pad_id=tok.pad_token_id)
    ours = _model(assets, "auto")
    assert ours.config._attn_implementation == "sdpa_varlen" and isinstance(ours.lm_head, LossHead)
    stock = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32, attn_implementation="sdpa")
    cpu = torch.device("cpu")
    results = []
    for model, mb in ((stock, padded), (ours, packed)):
        model.zero_grad()
        ce = ce_sum(model, mb, cpu, "fp32")
        ce.backward()
        results.append((ce.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (a, ga), (b, gb) = results
    assert abs(a - b) / padded.n_targets < 1e-5
    assert (ga - gb).abs().max() < 1e-4 * ga.abs().max()
    # Outside a loss the head is the plain linear layer: logits as before.
    with torch.no_grad():
        x = packed.input_ids[:, :16]
        assert torch.allclose(ours(input_ids=x).logits, stock(input_ids=x).logits, atol=1e-5)


@pytest.mark.unit
def test_token_groups_respect_the_budget():
    lengths = np.array([100, 200, 300, 700, 50, 50, 900, 10])
    groups = token_groups(lengths, 600)
    assert [lengths[g].tolist() for g in groups] == [[100, 200, 300], [700], [50, 50], [900], [10]]
    split = split_to(groups, 7)
    assert len(split) == 7 and [i for g in split for i in range(g.start, g.stop)] == list(range(len(lengths)))


@pytest.mark.unit
def test_token_budget_micro_batches_are_world_size_independent(assets, tok):
    f = str(assets / "data" / "train.parquet")
    c = DataConfig(train_files=[f], max_length=64, train_batch_size=16, micro_batch_size_per_gpu=1,
                   max_tokens_per_micro_batch=90, packing=True)
    ds = SFTDataset([f], SampleBuilder(tok, c), "train")
    ids = lambda mbs: [i for mb in mbs for i in mb.sample_ids]  # noqa: E731 - a one-line helper
    for cursor in (0, 16, 32):
        one = GlobalBatches(ds, c, 3, 0, 1, 0).step_batches(0, cursor)
        assert all(mb.n_tokens <= 90 or len(mb.sample_ids) == 1 for mb in one)
        assert len(one) < 16, "a token budget groups several samples per micro-batch"
        for world in (2, 4):
            ranks = [GlobalBatches(ds, c, 3, r, world, 0).step_batches(0, cursor) for r in range(world)]
            assert len({len(r) for r in ranks}) == 1, "every rank must run the same number of forwards"
            assert sorted(ids(one)) == sorted(i for r in ranks for i in ids(r)), "the same samples at every size"
            assert {len(ids(r)) for r in ranks} == {16 // world}


@pytest.mark.unit
def test_rank_shares_balance_tokens_with_the_same_sample_count():
    """Issue 30: the step waits for the busiest rank, so with a token budget each rank gets
    an equal count of samples but about equal tokens, not a contiguous slice of the batch."""
    rng = np.random.default_rng(0)
    worst_contiguous, worst_balanced = [], []
    for _ in range(200):
        lengths = np.minimum(rng.lognormal(5.3, 0.6, 16).astype(int) + 1, 512)
        for world in (2, 4):
            shares = rank_shares(lengths, world)
            assert sorted(p for s in shares for p in s.tolist()) == list(range(16))
            assert all(len(s) == 16 // world and list(s) == sorted(s) for s in shares)
            mean = lengths.sum() / world
            worst_balanced.append(max(lengths[s].sum() for s in shares) / mean)
            worst_contiguous.append(max(lengths[r * 16 // world:(r + 1) * 16 // world].sum()
                                        for r in range(world)) / mean)
    assert np.mean(worst_balanced) < 1.03 and np.mean(worst_contiguous) > 1.1, (
        np.mean(worst_balanced), np.mean(worst_contiguous))
    # Pure: the same lengths give the same shares; ties go to the lower rank.
    assert [s.tolist() for s in rank_shares(np.array([5, 5, 5, 5]), 2)] == [[0, 2], [1, 3]]


@pytest.mark.unit
def test_logged_sample_ids_are_in_batch_order_at_any_world_size(caplog):
    """metrics.jsonl's sample_ids compare across resizes although packed shares are not contiguous;
    a rank that trained anything else is written as it was, and logged."""
    assert logged_ids([7, 3, 9, 1], [[3, 1], [7, 9]]) == [7, 3, 9, 1]
    assert logged_ids([7, 3, 9, 1], [[3, 1], [7, 7]]) == [3, 1, 7, 7]
    assert "not the step's global batch [7, 3, 9, 1]" in caplog.text


@pytest.mark.unit
def test_packed_ranks_get_balanced_tokens_and_padded_ranks_contiguous_slices(assets, tok):
    f = str(assets / "data" / "train.parquet")
    packed = DataConfig(train_files=[f], max_length=64, train_batch_size=16, micro_batch_size_per_gpu=2)
    padded = DataConfig(train_files=[f], max_length=64, train_batch_size=16, micro_batch_size_per_gpu=2,
                        packing=False)
    ds = SFTDataset([f], SampleBuilder(tok, packed), "train")
    order = ds.epoch_order(3, 0, packed.shuffle)[:16]
    tokens = lambda mbs: sum(mb.n_tokens for mb in mbs)  # noqa: E731 - a one-line helper
    ranks = [GlobalBatches(ds, packed, 3, r, 2, 0).step_batches(0, 0) for r in range(2)]
    want = [order[rank_shares(ds.lengths[order], 2)[r]].tolist() for r in range(2)]
    assert [[i for mb in mbs for i in mb.sample_ids] for mbs in ranks] == want
    # Over the epoch the busiest rank (what each step waits for) carries fewer tokens than
    # with contiguous halves.
    busiest, halves = 0, 0
    for cursor in range(0, ds.epoch_size - 15, 16):
        busiest += max(tokens(GlobalBatches(ds, packed, 3, r, 2, 0).step_batches(0, cursor)) for r in range(2))
        ids = ds.epoch_order(3, 0, packed.shuffle)[cursor:cursor + 16]
        halves += max(ds.lengths[ids[:8]].sum(), ds.lengths[ids[8:]].sum())
    assert busiest < halves, (busiest, halves)
    rows = [GlobalBatches(ds, padded, 3, r, 2, 0).step_batches(0, 0) for r in range(2)]
    assert [[i for mb in mbs for i in mb.sample_ids] for mbs in rows] == [order[:8].tolist(), order[8:].tolist()]


@pytest.mark.unit
def test_by_default_micro_batches_are_packed_by_the_memory_of_micro_full_length_samples(assets, tok):
    """Issue 30: a user who sets only the shape gets packed rows filled to micro x max_length tokens
    (the memory that many full-length samples may take anyway), not micro padded sequences."""
    f = str(assets / "data" / "train.parquet")
    shape = dict(train_files=[f], max_length=64, train_batch_size=16, micro_batch_size_per_gpu=2)
    default, padded = DataConfig(**shape), DataConfig(**shape, packing=False)
    assert default.packing and default.token_budget() == 128
    assert padded.token_budget() is None
    assert DataConfig(**shape, max_tokens_per_micro_batch=90).token_budget() == 90
    ds = SFTDataset([f], SampleBuilder(tok, default), "train")
    assert ds.lengths.mean() < 32, "the test needs samples shorter than half of max_length"
    mbs = GlobalBatches(ds, default, 3, 0, 1, 0).step_batches(0, 0)
    assert all(mb.input_ids.shape[0] == 1 and mb.attention_mask is None for mb in mbs), "one packed row each"
    assert all(mb.n_tokens <= 128 for mb in mbs) and len(mbs) < 8, "fewer, fuller passes than 8 pairs"
    rows = GlobalBatches(ds, padded, 3, 0, 1, 0).step_batches(0, 0)
    assert [len(mb.sample_ids) for mb in rows] == [2] * 8
    assert [i for mb in mbs for i in mb.sample_ids] == [i for mb in rows for i in mb.sample_ids]


@pytest.mark.unit
def test_on_a_cpu_the_default_budget_has_a_floor_set_by_the_model_width(assets, tok, tmp_path):
    """Issue 30: a CPU micro-batch has a fixed cost and a narrow model's matmuls are small, so
    without data.max_tokens_per_micro_batch the trainer packs at least 786432 / hidden_size
    tokens there (none on GPUs); the samples and their order stay the same."""
    from sftjob_trainer.batching import CPU_MIN_ACTIVATION, min_micro_batch_tokens

    hidden = json.loads((assets / "model" / "config.json").read_text())["hidden_size"]
    floor = min_micro_batch_tokens(str(assets / "model"), torch.device("cpu"))
    assert floor == -(-CPU_MIN_ACTIVATION // hidden) and floor > 128
    assert min_micro_batch_tokens(str(assets / "model"), torch.device("cuda")) == 0
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 768}}))
    assert min_micro_batch_tokens(str(tmp_path), torch.device("cpu")) == 1024
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 1536}))
    assert min_micro_batch_tokens(str(tmp_path), torch.device("cpu")) == 512
    assert min_micro_batch_tokens(str(tmp_path / "missing"), torch.device("cpu")) == 0

    f = str(assets / "data" / "train.parquet")
    shape = dict(train_files=[f], max_length=64, train_batch_size=16, micro_batch_size_per_gpu=2)
    default = DataConfig(**shape)
    assert default.token_budget(floor) == floor and default.token_budget(10) == 128
    assert DataConfig(**shape, max_tokens_per_micro_batch=90).token_budget(floor) == 90
    assert DataConfig(**shape, packing=False).token_budget(floor) is None
    ds = SFTDataset([f], SampleBuilder(tok, default), "train")
    plain = GlobalBatches(ds, default, 3, 0, 1, 0).step_batches(0, 0)
    floored = GlobalBatches(ds, default, 3, 0, 1, 0, min_tokens=floor).step_batches(0, 0)
    assert len(floored) < len(plain) and max(mb.n_tokens for mb in floored) > 128
    assert all(mb.n_tokens <= floor for mb in floored)
    assert [i for mb in floored for i in mb.sample_ids] == [i for mb in plain for i in mb.sample_ids]


@pytest.mark.distributed
def test_packing_and_token_budget_give_the_padded_per_step_losses(assets, tmp_path):
    """Real trainer runs: same samples per step, so packed/token-budget losses equal the padded ones
    (and the allocator, tcmalloc or the C library's, changes none of them; oneMKL's kernels, as it
    chooses them or by instruction set, and the attention kernel, sftjob's or torch's sdpa, change
    them only by fp32 rounding)."""
    over = {"trainer.total_training_steps": 4, "data.micro_batch_size_per_gpu": 4, "data.shuffle": "false",
            "trainer.peak_tflops": 1.0}
    variants = {
        "padded": {"data.packing": "false", "model.attn_implementation": "sdpa"},
        "packed": {"data.packing": "true"},
        "budget": {"data.packing": "true", "data.max_tokens_per_micro_batch": 100},
        "packed, glibc": {"data.packing": "true"},
        "packed, mkl vendor": {"data.packing": "true", "trainer.cpu_mkl_dispatch": "vendor"},
        "packed, torch attention": {"data.packing": "true", "trainer.cpu_attention": "sdpa"},
    }
    losses = {}
    for name, extra in variants.items():
        out = tmp_path / name.replace(", ", "-").replace(" ", "-")
        # Two runs keep the C library's malloc (an empty LD_PRELOAD is the user's choice); the
        # others run on the tcmalloc the launcher preloads, which changes no loss (not one bit).
        glibc = {"LD_PRELOAD": ""} if name in ("padded", "packed, glibc") else None
        res = runner.run(runner.base_args(assets, out, **over, **extra), out, extra_env=glibc)
        assert res.code == 0, res.why()
        steps = res.steps()
        losses[name] = [r["loss"] for r in steps]
        assert all(0 < r["mfu"] < 1 and r["time"] > 0 for r in steps)
        # The CPU floor under the default budget (packed only; an explicit budget is the user's).
        assert ("on a CPU the trainer packs at least" in res.output) == name.startswith("packed"), name
        # The trainer's own line (read from its mappings), not only the launcher's choice.
        mapped = [line for line in res.output.splitlines()
                  if "memory allocator: tcmalloc" in line and "sftjob launch:" not in line]
        assert bool(mapped) == (glibc is None), res.why()
        # Rank 0 says which GEMM kernels oneMKL was left to or given (cpu_blas.py): given on an
        # AMD CPU with AVX2 and FMA, unless the config says vendor.
        mkl = why_not(extra.get("trainer.cpu_mkl_dispatch", "instruction_set"), read_cpu())
        said = "by this AMD CPU's instruction sets" if mkl is None else mkl
        assert sum("oneMKL GEMM kernels:" in line and said in line for line in res.output.splitlines()) == 1, \
            res.why()
        # ... and which kernel runs the packed rows' attention (cpu_attention.py): sftjob's where
        # the CPU can run it, unless the config says sdpa.
        kernel = extra.get("trainer.cpu_attention", "auto") == "auto" and why_not_attention(read_cpu()) is None
        said = "sftjob's causal kernel" if kernel else "torch's sdpa"
        assert sum("CPU attention:" in line and said in line for line in res.output.splitlines()) == 1, res.why()
    assert len(losses["padded"]) == 4
    assert losses["packed, glibc"] == losses["packed"]
    for name in ("packed", "budget", "packed, mkl vendor", "packed, torch attention"):
        assert max(abs(a - b) for a, b in zip(losses["padded"], losses[name])) < 1e-4, (name, losses)


@pytest.mark.unit
def test_mfu_flops_follow_the_bench_formula():
    """N_matmul of the bench model is the README's 12,587,904; tied heads are still counted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sftjob_trainer.metrics import step_flops
    from sftjob_trainer.model import attention_dims, matmul_params

    cfg = json.loads((Path(__file__).resolve().parents[2] / "bench" / "model_config.json").read_text())
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    assert matmul_params(model) == 12_587_904
    assert attention_dims(model) == (6, 384)
    assert step_flops(12_587_904, 6, 384, [100, 300]) == 6 * 12_587_904 * 400 + 6 * 6 * 384 * (100**2 + 300**2)
    tied = LlamaForCausalLM(LlamaConfig(**{**cfg, "tie_word_embeddings": True}))
    assert matmul_params(tied) == 12_587_904
