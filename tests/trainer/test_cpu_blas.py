"""trainer.cpu_mkl_dispatch: oneMKL's GEMM kernels chosen by instruction set on AMD CPUs (cpu_blas.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sftjob_trainer.cpu_blas import CODE_LEN, CpuInfo, cached_answer_offset, read_cpu, why_not, writable

pytestmark = pytest.mark.unit

AMD = CpuInfo("x86_64", "AuthenticAMD", frozenset({"avx2", "fma", "sse4_2"}))


@pytest.mark.parametrize("setting, cpu, reason", [
    ("instruction_set", AMD, None),
    ("vendor", AMD, "trainer.cpu_mkl_dispatch=vendor"),
    ("instruction_set", CpuInfo("x86_64", "GenuineIntel", AMD.flags), "CPU vendor GenuineIntel"),
    ("instruction_set", CpuInfo("x86_64", "", AMD.flags), "CPU vendor unknown"),
    ("instruction_set", CpuInfo("aarch64", "", frozenset()), "not an x86-64 CPU (aarch64)"),
    ("instruction_set", CpuInfo("x86_64", "AuthenticAMD", frozenset({"avx", "fma"})), "lacks avx2"),
    ("instruction_set", CpuInfo("x86_64", "AuthenticAMD", frozenset({"avx2"})), "lacks fma"),
])
def test_only_an_amd_cpu_with_avx2_and_fma_is_changed(setting, cpu, reason):
    got = why_not(setting, cpu)
    assert got is None if reason is None else reason in got


def test_the_cached_answer_is_found_only_in_the_exact_code_sequence():
    # mov eax, [rip + 0x100]; test eax, eax; js +1; ret: the variable is 6 + 0x100 past the function.
    code = bytes.fromhex("8b05" "00010000" "85c07801c3")
    assert len(code) == CODE_LEN
    assert cached_answer_offset(code) == 6 + 0x100
    assert cached_answer_offset(bytes.fromhex("8b05" "f0ffffff" "85c07801c3")) == 6 - 16
    for other in (bytes.fromhex("8b0d" "00010000" "85c07801c3"),   # loads ecx
                  bytes.fromhex("8b05" "00010000" "85c07901c3"),   # jns
                  bytes.fromhex("8b05" "00010000" "85c078"),       # too short
                  b"\x90" * CODE_LEN):
        assert cached_answer_offset(other) is None, other.hex()


def test_only_the_librarys_writable_mappings_count():
    maps = ["7f0000000000-7f0000100000 r-xp 00000000 08:01 12 /venv/torch/lib/libtorch_cpu.so",
            "7f0000100000-7f0000200000 rw-p 00100000 08:01 12 /venv/torch/lib/libtorch_cpu.so",
            "7f0000200000-7f0000300000 rw-p 00000000 00:00 0 "]
    assert writable(0x7f0000100010, maps)
    assert not writable(0x7f0000000010, maps)   # its code
    assert not writable(0x7f0000200010, maps)   # anonymous memory
    assert not writable(0x7f0000300010, maps)


PROBE = """
import ctypes, json, sys
from sftjob_trainer.cpu_blas import FUNCTION, _loaded_library, dispatch_by_instruction_set
if sys.argv[2] == "unloaded":   # torch not imported yet: the call must load it itself
    assert "torch" not in sys.modules
    line = dispatch_by_instruction_set(sys.argv[1])
import torch
torch.manual_seed(0)
a, b = torch.randn(256, 384), torch.randn(384, 320)
if sys.argv[2] == "late":
    a @ b
if sys.argv[2] != "unloaded":
    line = dispatch_by_instruction_set(sys.argv[1])
product = a @ b
answer = getattr(ctypes.CDLL(_loaded_library(open("/proc/self/maps"))), FUNCTION)()
print(json.dumps({"line": line, "answer": answer, "product": product.flatten()[:4096].tolist()}))
"""


def probe(setting: str, when: str = "first") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, setting, when], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_this_cpu_gets_the_kernels_its_instruction_set_allows():
    """In a fresh process (this one may have run products already): on an AMD CPU with AVX2 and
    FMA oneMKL treats the CPU as Intel's and products stay the same to fp32 rounding; elsewhere,
    and with ``vendor``, nothing changes and the line says why."""
    reason = why_not("instruction_set", read_cpu())
    chosen, own = probe("instruction_set"), probe("vendor")
    assert "trainer.cpu_mkl_dispatch=vendor" in own["line"]
    if reason is None:
        assert "by this AMD CPU's instruction sets" in chosen["line"], chosen["line"]
        assert chosen["answer"] == 1 and own["answer"] == 0
        # Too late once oneMKL has chosen: left alone, said so.
        late = probe("instruction_set", "late")
        assert "a product ran first" in late["line"] and late["answer"] == 0
        # A caller that has not imported torch yet gets the same choice (bench.kernels is one).
        unloaded = probe("instruction_set", "unloaded")
        assert unloaded["line"] == chosen["line"] and unloaded["answer"] == 1
    else:
        assert reason in chosen["line"]
    assert torch.allclose(torch.tensor(chosen["product"]), torch.tensor(own["product"]), rtol=1e-5, atol=1e-4)
