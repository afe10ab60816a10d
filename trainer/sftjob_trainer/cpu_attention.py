"""sftjob's CPU attention kernel: causal attention over a packed row's sequences, fp32, x86-64.

``csrc/cpu_attention.c`` computes what ``sdpa_varlen`` (attention.py) computes with one torch
sdpa call per sequence, in one call per layer for the whole row: the causal half of each
sequence's scores only, tile by tile, every product through one register-blocked AVX2/FMA loop,
threads from torch's own OpenMP pool. Measured on a 2-core AVX2 EPYC on packed rows of the
bench model's heads (6 query heads over 2 KV heads of 64, sequences of 16-512 tokens):
1.85-2.16x torch's CPU flash kernel per sequence, forward plus backward (bench/README.md). Its
results match torch's to fp32 rounding (not bit for bit: the sums run in another order) and
depend on neither the thread count nor the scheduling.

``trainer.cpu_attention`` picks it (`choose`, once per process, before the model runs):
``auto`` uses it where it applies (`applies`: fp32 tensors on a CPU with AVX2 and FMA, no
dropout, head_dim a multiple of 16) and torch's sdpa elsewhere; ``sdpa`` never uses it. The
library comes prebuilt in the trainer image (its Dockerfile runs ``csrc/build.sh`` into this
package as ``libsftjob_cpu_attention.so``); elsewhere (a source checkout, the tests, the
bench) it is built once with the machine's C compiler into the user's cache, named by the
source's hash. Where neither is possible ``auto`` keeps sdpa, and the line the trainer logs
says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .cpu_blas import CpuInfo, read_cpu

# The package's own directory (its data: the C source in a checkout, the library in the image).
HERE = Path(str(importlib.resources.files("sftjob_trainer")))
SOURCE = HERE / "csrc" / "cpu_attention.c"
BUILD_SCRIPT = HERE / "csrc" / "build.sh"
PREBUILT = HERE / "libsftjob_cpu_attention.so"
SETTINGS = ("auto", "sdpa")
FIELD = "trainer.cpu_attention"

_lib: ctypes.CDLL | None = None   # set by choose("auto") where the kernel can run


class Unavailable(Exception):
    """The kernel cannot run here; the message says why."""


def why_not(cpu: CpuInfo) -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if cpu.machine not in ("x86_64", "AMD64"):
        return f"the kernel is x86-64 code and this machine is {cpu.machine}"
    missing = sorted({"avx2", "fma"} - cpu.flags)
    return f"this CPU lacks {' and '.join(missing)}" if missing else None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sftjob" / "kernels"


def built_path() -> Path:
    """Where a build of this source goes: named by the source's and the build script's hash."""
    digest = hashlib.sha256(SOURCE.read_bytes() + BUILD_SCRIPT.read_bytes()).hexdigest()[:16]
    return cache_dir() / f"cpu_attention-{digest}.so"


def build(out: Path) -> None:
    """Compile the kernel into out with csrc/build.sh (written whole or not at all)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run(["sh", str(BUILD_SCRIPT), tmp], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise Unavailable(f"building {SOURCE.name} failed (exit {res.returncode}): "
                              f"{(res.stderr or res.stdout).strip()[-500:]}")
        os.replace(tmp, out)   # another process building the same file replaces it with the same bytes
    except (OSError, subprocess.SubprocessError) as err:
        raise Unavailable(f"cannot build {SOURCE.name}: {err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> Path:
    """The prebuilt library, else this source's build in the cache (made now if missing)."""
    if PREBUILT.exists():
        return PREBUILT
    if not SOURCE.exists():
        raise Unavailable(f"neither {PREBUILT.name} nor its source is installed with sftjob_trainer")
    out = built_path()
    if not out.exists():
        build(out)
    return out


def load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))   # after torch: its libgomp.so.1 is the one this library gets
    except OSError as err:
        raise Unavailable(f"cannot load {path}: {err}") from err
    ptr, i64p, i64, f32, i32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_float, \
        ctypes.c_int
    lib.sftjob_attention_forward.argtypes = [ptr] * 5 + [i64p, i64p] + [i64] * 5 + [f32, i32]
    lib.sftjob_attention_backward.argtypes = [ptr] * 9 + [i64p, i64p] + [i64] * 5 + [f32, i32]
    lib.sftjob_attention_forward.restype = lib.sftjob_attention_backward.restype = i32
    return lib


def choose(setting: str) -> str:
    """Apply trainer.cpu_attention in this process; the line to log."""
    global _lib
    _lib = None
    if setting not in SETTINGS:
        raise ValueError(f"{FIELD}={setting!r}: expected one of {', '.join(SETTINGS)}")
    if setting == "sdpa":
        return f"CPU attention: torch's sdpa, one call per sequence ({FIELD}=sdpa)"
    reason = why_not(read_cpu())
    try:
        if reason:
            raise Unavailable(reason)
        path = library()
        _lib = load(path)
    except Unavailable as err:
        return f"CPU attention: torch's sdpa, one call per sequence ({FIELD}=auto, sftjob's kernel unavailable: {err})"
    return f"CPU attention: sftjob's causal kernel for fp32 packed rows, {path} ({FIELD}=auto)"


def chosen() -> bool:
    return _lib is not None


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, scale: float | None) -> bool:
    """Whether the chosen kernel takes these [1, heads, tokens, head_dim] tensors."""
    if _lib is None or dropout or (scale is not None and scale <= 0):
        return False
    tensors = (query, key, value)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 4 and t.shape[0] == 1
                and t.stride(-1) == 1 for t in tensors)
            and query.shape[-1] % 16 == 0 and key.shape[-1] == query.shape[-1] == value.shape[-1]
            and query.shape[2] == key.shape[2] == value.shape[2] and key.shape[1] == value.shape[1]
            and query.shape[1] % key.shape[1] == 0)


def _strides(*ts: torch.Tensor) -> ctypes.Array:
    """(head, token) strides of [1, heads, tokens, head_dim] tensors, in elements."""
    flat = [s for t in ts for s in (t.stride(1), t.stride(2))]
    return (ctypes.c_int64 * len(flat))(*flat)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _bounds(b: torch.Tensor):
    return ctypes.cast(b.data_ptr(), ctypes.POINTER(ctypes.c_int64))


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"sftjob's CPU attention kernel ({what}): "
                           + {1: "shapes it does not take", 2: "sequence bounds not increasing within the row",
                              3: "out of memory"}.get(rc, f"error {rc}"))


class _PackedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, bounds, scale):
        assert _lib is not None
        _, hq, tokens, d = query.shape
        out = query.new_empty(1, tokens, hq, d).transpose(1, 2)   # [1, hq, tokens, d] over [tokens, hq, d]
        lse = query.new_empty(hq, tokens)
        with torch.profiler.record_function("sftjob::cpu_attention_forward"):
            _check(_lib.sftjob_attention_forward(
                _ptr(query), _ptr(key), _ptr(value), _ptr(out), _ptr(lse), _strides(query, key, value, out),
                _bounds(bounds), bounds.numel() - 1, tokens, hq, key.shape[1], d, scale, torch.get_num_threads()),
                "forward")
        ctx.save_for_backward(query, key, value, out, lse, bounds)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        assert _lib is not None
        query, key, value, out, lse, bounds = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        _, hq, tokens, d = query.shape
        dq = query.new_empty(1, tokens, hq, d).transpose(1, 2)
        dk = key.new_empty(1, tokens, key.shape[1], d).transpose(1, 2)
        dv = value.new_empty(1, tokens, value.shape[1], d).transpose(1, 2)
        with torch.profiler.record_function("sftjob::cpu_attention_backward"):
            _check(_lib.sftjob_attention_backward(
                _ptr(query), _ptr(key), _ptr(value), _ptr(out), _ptr(dout), _ptr(lse), _ptr(dq), _ptr(dk), _ptr(dv),
                _strides(query, key, value, out, dout, dq, dk, dv), _bounds(bounds), bounds.numel() - 1, tokens, hq,
                key.shape[1], d, ctx.scale, torch.get_num_threads()), "backward")
        return dq, dk, dv, None, None


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                            scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence [bounds[i], bounds[i+1]) of a packed row.

    query [1, hq, tokens, d], key/value [1, hk, tokens, d] (any strides, d contiguous); returns
    [1, tokens, hq, d] like a transformers attention function. Only where `applies` said so.
    """
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"sequence bounds {bounds[0]}..{bounds[-1]} do not cover the row's {query.shape[2]} tokens")
    b = torch.tensor(bounds, dtype=torch.int64)
    s = float(scale) if scale is not None else query.shape[-1] ** -0.5
    out = _PackedCausal.apply(query, key, value, b, s)
    return out.transpose(1, 2)
