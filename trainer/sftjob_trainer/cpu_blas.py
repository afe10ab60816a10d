"""oneMKL's GEMM kernels on AMD CPUs: chosen by the instruction set, not by the vendor.

torch's x86 builds run fp32 matrix products (and bf16 ones widened to fp32, precision.py)
through Intel oneMKL, linked into ``libtorch_cpu.so``. oneMKL chooses its kernels after
asking once whether the CPU's vendor is "GenuineIntel" (``mkl_serv_intel_cpu_true``); on
an AMD CPU the answer is no, and its products run slower kernels than the CPU's own AVX2/FMA
(or AVX-512) allow. Measured on a 2-core AMD EPYC (Zen 2, AVX2) with the sweep model's
shapes: 130-158 GFLOP/s as oneMKL chooses, 182-203 by the instruction set (bench/README.md,
issue 30). The results are products of the same operands in fp32 either way; no test of
the trainer's losses (bitwise resume included) depends on which kernel ran.

The answer is cached in a variable of oneMKL's own, negative until the first ask, and the
function's first instruction loads it. ``trainer.cpu_mkl_dispatch: instruction_set`` (the
default) sets that variable to 1 before torch's first product, after which oneMKL picks
kernels by the CPU's instruction sets as on an Intel CPU. Only when everything is as this
was written against: Linux on x86-64, an AMD CPU with avx2 and fma, a loaded
``libtorch_cpu.so`` exporting the function, its code the exact sequence decoded below, the
variable in a writable mapping of that library, and oneMKL not asked yet. Anything else is
left alone, and the line the trainer logs says why. ``vendor`` leaves oneMKL's own choice.
"""
from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass

FUNCTION = "mkl_serv_intel_cpu_true"
LIBRARY = "libtorch_cpu.so"
# mov eax, [rip + rel32]; test eax, eax; js +1; ret  -- load the cached answer, return it
# unless negative (not asked yet).
_LOAD = b"\x8b\x05"
_RETURN_IF_CACHED = b"\x85\xc0\x78\x01\xc3"
CODE_LEN = len(_LOAD) + 4 + len(_RETURN_IF_CACHED)


@dataclass(frozen=True)
class CpuInfo:
    machine: str
    vendor: str
    flags: frozenset[str]   # x86 flags; empty where /proc/cpuinfo has none (other architectures)
    known: bool = True      # False: /proc/cpuinfo could not be read (not Linux)


def read_cpu() -> CpuInfo:
    vendor, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if vendor and flags:
                    break
    except OSError:
        return CpuInfo(platform.machine(), "", flags, known=False)
    return CpuInfo(platform.machine(), vendor, flags)


def cached_answer_offset(code: bytes) -> int | None:
    """Where the function's cached answer lives, relative to the function's address, when
    ``code`` (its first bytes) is the load-test-return sequence above; else None."""
    if len(code) < CODE_LEN or not code.startswith(_LOAD) or code[6:CODE_LEN] != _RETURN_IF_CACHED:
        return None
    return 6 + int.from_bytes(code[2:6], "little", signed=True)


def why_not(setting: str, cpu: CpuInfo) -> str | None:
    """Why the dispatch is left as oneMKL chooses (None: go on to the library)."""
    if setting != "instruction_set":
        return f"trainer.cpu_mkl_dispatch={setting}"
    if cpu.machine not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({cpu.machine})"
    if cpu.vendor != "AuthenticAMD":
        return f"CPU vendor {cpu.vendor or 'unknown'}: oneMKL's own choice is by instruction set there"
    if missing := sorted({"avx2", "fma"} - cpu.flags):
        return f"this AMD CPU lacks {', '.join(missing)}"
    return None


def writable(address: int, maps: Iterable[str]) -> bool:
    """Whether ``address`` lies in a readable and writable mapping of libtorch_cpu (its data)."""
    for line in maps:
        fields = line.split()
        if len(fields) < 6 or not fields[5].endswith(LIBRARY):
            continue
        low, _, high = fields[0].partition("-")
        if int(low, 16) <= address < int(high, 16) and fields[1].startswith("rw"):
            return True
    return False


def _loaded_library(maps: Iterable[str]) -> str | None:
    return next((fields[5] for fields in map(str.split, maps) if len(fields) >= 6 and fields[5].endswith(LIBRARY)),
                None)


def dispatch_by_instruction_set(setting: str = "instruction_set") -> str:
    """Apply ``trainer.cpu_mkl_dispatch`` in this process; the line to log. Call before the
    process's first matrix product."""
    head = "oneMKL GEMM kernels"
    if reason := why_not(setting, read_cpu()):
        return f"{head}: as oneMKL chooses ({reason})"
    import torch  # noqa: F401  (loads libtorch_cpu.so, where oneMKL's answer is written)
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.readlines()
    except OSError:
        maps = []
    path = _loaded_library(maps)
    if path is None:
        return f"{head}: as oneMKL chooses ({LIBRARY} is not loaded)"
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        function = ctypes.cast(getattr(lib, FUNCTION), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return f"{head}: as oneMKL chooses ({LIBRARY} has no {FUNCTION}: not the oneMKL build this was written for)"
    assert function is not None
    offset = cached_answer_offset(ctypes.string_at(function, CODE_LEN))
    if offset is None:
        return f"{head}: as oneMKL chooses ({FUNCTION}'s code is not the sequence this was written for)"
    if not writable(function + offset, maps):
        return f"{head}: as oneMKL chooses ({FUNCTION}'s cached answer is not in the library's data)"
    answer = ctypes.c_int.from_address(function + offset)
    if answer.value == 1:
        return f"{head}: by instruction set (oneMKL already treats this CPU as Intel's)"
    if answer.value >= 0:
        return f"{head}: as oneMKL chooses (it chose before the trainer could set it: a product ran first)"
    answer.value = 1
    return (f"{head}: by this AMD CPU's instruction sets "
            "(trainer.cpu_mkl_dispatch=instruction_set; vendor: oneMKL's own choice)")
