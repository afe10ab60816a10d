"""trainer.cpu_attention: sftjob's causal attention kernel for packed fp32 rows (cpu_attention.py, csrc/)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sftjob_trainer import attention, cpu_attention
from sftjob_trainer.cpu_blas import CpuInfo, read_cpu

pytestmark = pytest.mark.unit

CAN_RUN = cpu_attention.why_not(read_cpu()) is None
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="this CPU cannot run the kernel (x86-64 with AVX2 and FMA)")


@pytest.fixture
def kernel():
    line = cpu_attention.choose("auto")
    assert cpu_attention.chosen(), line
    yield line
    cpu_attention.choose("sdpa")


def projections(lens, hq, hk, d, seed=0, dtype=torch.float32):
    """q, k, v as a transformers attention layer hands them over: [1, tokens, heads, d] viewed as
    [1, heads, tokens, d] (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return [torch.randn(1, t, h, d, generator=g, dtype=dtype).transpose(1, 2).requires_grad_() for h in (hq, hk, hk)]


def bounds(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def per_sequence_sdpa(q, k, v, lens):
    parts = [F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
             for a, b, c in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))]
    return torch.cat(parts, 2).transpose(1, 2)


def forward_backward(fn, q, k, v, lens, seed=1):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, lens)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * grad).sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


def kernel_fn(q, k, v, lens):
    return cpu_attention.packed_causal_attention(q, k, v, bounds(lens))


@needs_kernel
@pytest.mark.parametrize("lens,hq,hk,d", [
    ([5], 4, 2, 16),                       # the tests' tiny model: one short sequence
    ([1, 47, 48, 49, 100], 6, 2, 64),      # the bench model's heads; lengths around the 48-row blocks
    ([84, 200, 456, 37, 1], 6, 6, 32),     # no grouped heads
    ([300], 8, 1, 128),                    # one KV head for all, head_dim 128
])
def test_matches_torch_sdpa_per_sequence(kernel, lens, hq, hk, d):
    q, k, v = projections(lens, hq, hk, d)
    out, grads = forward_backward(kernel_fn, q, k, v, lens)
    assert out.shape == (1, sum(lens), hq, d) and out.is_contiguous()
    # The reference in float64: the kernel's error, not torch's, is what is bounded.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_grads = forward_backward(per_sequence_sdpa, q64, k64, v64, lens)
    assert (out.double() - ref).abs().max() < 2e-6
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item())


@needs_kernel
def test_results_do_not_depend_on_the_thread_count(kernel):
    lens = [84, 200, 456, 37, 1, 120, 300, 90]
    q, k, v = projections(lens, 6, 2, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = forward_backward(kernel_fn, q, k, v, lens)
        torch.set_num_threads(max(2, threads))
        many = forward_backward(kernel_fn, q, k, v, lens)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1], many[1]))


@needs_kernel
def test_packed_rows_go_to_the_kernel_only_where_it_applies(kernel, monkeypatch):
    calls = []
    real = cpu_attention.packed_causal_attention
    monkeypatch.setattr(cpu_attention, "packed_causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    module = torch.nn.Module()
    lens = [30, 50]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    q, k, v = projections(lens, 4, 2, 16)
    out, _ = attention.varlen_sdpa_attention(module, q, k, v, None, position_ids=pos)
    assert calls == [1]
    assert (out - per_sequence_sdpa(q, k, v, lens)).abs().max() < 1e-5
    # Not taken (torch's sdpa runs): bf16, dropout, a head_dim that is no multiple of 16.
    for args, kwargs in ((projections(lens, 4, 2, 16, dtype=torch.bfloat16), {}),
                         (projections(lens, 4, 2, 16), {"dropout": 0.1}),
                         (projections(lens, 4, 2, 8), {})):
        attention.varlen_sdpa_attention(module, *args, None, position_ids=pos, **kwargs)
    assert calls == [1]
    cpu_attention.choose("sdpa")
    attention.varlen_sdpa_attention(module, q, k, v, None, position_ids=pos)
    assert calls == [1] and not cpu_attention.chosen()


def test_choose_says_what_runs_and_why(monkeypatch, tmp_path):
    assert "torch's sdpa" in cpu_attention.choose("sdpa") and not cpu_attention.chosen()
    with pytest.raises(ValueError, match="trainer.cpu_attention='fast'"):
        cpu_attention.choose("fast")
    arm = CpuInfo("aarch64", "", frozenset())
    no_fma = CpuInfo("x86_64", "AuthenticAMD", frozenset({"avx", "avx2"}))
    assert cpu_attention.why_not(arm) == "the kernel is x86-64 code and this machine is aarch64"
    assert cpu_attention.why_not(no_fma) == "this CPU lacks fma"
    monkeypatch.setattr(cpu_attention, "read_cpu", lambda: no_fma)
    line = cpu_attention.choose("auto")
    assert "torch's sdpa" in line and "this CPU lacks fma" in line and not cpu_attention.chosen()


@needs_kernel
def test_without_a_prebuilt_library_it_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_attention, "PREBUILT", tmp_path / "absent.so")
    path = cpu_attention.built_path()
    assert path.parent == tmp_path / "cache" / "sftjob" / "kernels" and not path.exists()
    try:
        line = cpu_attention.choose("auto")
        assert cpu_attention.chosen() and str(path) in line, line
        built = path.stat().st_mtime_ns
        cpu_attention.choose("auto")
        assert path.stat().st_mtime_ns == built and sorted(os.listdir(path.parent)) == [path.name]
    finally:
        cpu_attention.choose("sdpa")


def test_a_failed_build_leaves_sdpa_and_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(cpu_attention, "PREBUILT", tmp_path / "absent.so")
    monkeypatch.setattr(cpu_attention, "read_cpu", lambda: CpuInfo("x86_64", "", frozenset({"avx2", "fma"})))
    line = cpu_attention.choose("auto")
    assert "building cpu_attention.c failed (exit 1)" in line and not cpu_attention.chosen(), line
    assert os.listdir(tmp_path / "cache" / "sftjob" / "kernels") == []
    monkeypatch.setattr(cpu_attention, "SOURCE", tmp_path / "no-source.c")
    assert "neither absent.so nor its source is installed" in cpu_attention.choose("auto")


def test_the_build_script_warns_of_nothing_and_builds_x86_64_only(tmp_path):
    res = subprocess.run(["sh", str(cpu_attention.BUILD_SCRIPT), str(tmp_path / "k.so")], capture_output=True,
                         text=True)
    if os.uname().machine == "x86_64":
        assert res.returncode == 0 and res.stderr == "", res.stderr
        assert (tmp_path / "k.so").stat().st_size > 0
    # Another machine: exit 3 and nothing built (the image then has no library; uname faked here).
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text("#!/bin/sh\necho aarch64\n")
    (fake / "uname").chmod(0o755)
    res = subprocess.run(["sh", str(cpu_attention.BUILD_SCRIPT), str(tmp_path / "arm.so")], capture_output=True,
                         text=True, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert res.returncode == 3 and "not built on aarch64" in res.stderr
    assert not Path(tmp_path / "arm.so").exists()


@needs_kernel
def test_bounds_must_cover_the_row(kernel):
    q, k, v = projections([10, 10], 4, 2, 16)
    with pytest.raises(ValueError, match="do not cover the row's 20 tokens"):
        cpu_attention.packed_causal_attention(q, k, v, [0, 10])
