"""trainer.cpu_offload and model.liger_kernel: GPU-only, refused elsewhere naming the field.

Their GPU behaviour (losses with and without, peak memory) is `make gpu-check`'s
(tests/gpu/test_kernels.py: offload, liger)."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from sftjob_trainer.errors import InvalidConfig
from sftjob_trainer.model import apply_liger, check_device_options

from .runner import base_args, run

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field", ["trainer.cpu_offload", "model.liger_kernel"])
def test_a_cpu_run_refuses_gpu_only_options_with_exit_2(assets, tmp_path, field):
    res = run(base_args(assets, tmp_path, **{field: "true"}), tmp_path)
    assert res.code == 2 and f"{field}:" in res.output and "Set it to false" in res.output, res.output[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


def test_liger_needs_its_package_on_a_gpu(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(InvalidConfig, match=r"model.liger_kernel: the liger-kernel package is not installed"):
        check_device_options(True, False, torch.device("cuda", 0))
    check_device_options(False, True, torch.device("cuda", 0))  # offload needs nothing more


def test_liger_applies_its_norm_swiglu_and_rope_only_to_supported_architectures(monkeypatch):
    """With a stand-in for liger-kernel (not installed on CPU machines): the call and its flags."""
    calls = []
    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen2": None}
    fake._apply_liger_kernel_to_instance = lambda **kw: calls.append(kw)
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)

    with pytest.raises(InvalidConfig, match=r"model.liger_kernel: Liger has no kernels for model_type 'gpt2'"):
        apply_liger(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))
    model = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    apply_liger(model)
    # Our chunked loss head stays the loss: Liger's cross-entropies are off.
    assert calls == [dict(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                          fused_linear_cross_entropy=False)]


def test_compile_without_a_cpp_compiler_is_refused_naming_the_field(assets, tmp_path):
    """trainer.compile on the CPU builds inductor's C++ kernels at the first step; an image
    without a C++ compiler (the project's CPU image has none) failed there, retryably, with
    inductor's InvalidCxxCompiler. It is refused up front as a permanent InvalidConfig."""
    res = run(base_args(assets, tmp_path, **{"trainer.compile": "true"}), tmp_path,
              extra_env={"CXX": str(tmp_path / "no-such-g++")})
    assert res.code == 2, res.why()
    assert "InvalidConfig: trainer.compile: torch.compile on the CPU builds its kernels with a C++ compiler" \
        in res.output, res.why()
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.parametrize("compiled,liger,field",
                         [(True, False, "trainer.compile"), (False, True, "model.liger_kernel")])
def test_triton_kernels_on_a_gpu_need_a_c_compiler(monkeypatch, compiled, liger, field):
    """Triton (torch.compile's GPU backend, Liger's kernels) builds its launcher with $CC, else
    gcc or clang; without one the first step failed. The GPU check runs without a GPU."""
    import shutil

    from sftjob_trainer.model import check_compilers

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(InvalidConfig, match=rf"{field}: Triton builds .* with a C compiler"):
        check_compilers(compiled, liger, torch.device("cuda", 0))
    check_compilers(False, False, torch.device("cuda", 0))  # neither option: nothing to build
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}" if name == "gcc" else None)
    check_compilers(compiled, liger, torch.device("cuda", 0))
