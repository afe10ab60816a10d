"""tcmalloc under the trainer: the launcher and the trainer's entry point both use it.

A training step allocates and frees its activations afresh, tens of MB each. glibc's malloc
serves blocks that large from fresh mappings (or trims them off its heap) and hands them back
to the kernel when they are freed, so every new activation is page-faulted in again; on a
CPU that fault time is most of what an elementwise operator costs (bench/README.md, issue
30). tcmalloc keeps freed memory for the next allocation. It has to be chosen before the
process starts (``LD_PRELOAD``), so the launcher sets it for torchrun and the trainer
processes, and a trainer started any other way (``python -m sftjob_trainer``,
``sftjob-train``) re-executes itself once with it.

``LD_PRELOAD`` already in the environment, even empty (``spec.resources.env`` can set it),
is the user's choice and is left alone; without the library (the GPU image) nothing changes.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable

TCMALLOC = "tcmalloc_minimal"
PRELOAD = "LD_PRELOAD"
# tcmalloc reports every allocation over 1 GiB on stderr; loading a large model's weights
# makes many, and none of them is a problem.
TCMALLOC_REPORT = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"


def allocator_env(env: dict[str, str], find: Callable[[str], str | None] = ctypes.util.find_library
                  ) -> tuple[dict[str, str], str]:
    """The environment with tcmalloc preloaded, and a line saying which allocator runs."""
    if PRELOAD in env:
        return env, f"memory allocator: as LD_PRELOAD={env[PRELOAD]!r} sets it"
    lib = find(TCMALLOC)
    if not lib:
        return env, "memory allocator: the C library's malloc (no tcmalloc here)"
    return ({**env, PRELOAD: lib, TCMALLOC_REPORT: env.get(TCMALLOC_REPORT, str(1 << 40))},
            f"memory allocator: tcmalloc ({lib}); an LD_PRELOAD in the environment, even empty, overrides it")


def reexec_with_allocator() -> None:
    """Run this very command again with tcmalloc preloaded, unless the environment already
    says which allocator to use. Called first thing, before torch is imported; the process
    keeps its pid (``execve``), so a supervisor's signals still reach it."""
    env, _ = allocator_env(dict(os.environ))
    if PRELOAD in env and PRELOAD not in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def in_use() -> str:
    """What this process allocates with, read from its own mappings (the trainer logs it)."""
    try:
        with open("/proc/self/maps") as fh:
            tcmalloc = any(f"lib{TCMALLOC}" in line for line in fh)
    except OSError:
        return "memory allocator: unknown (no /proc/self/maps)"
    if tcmalloc:
        return "memory allocator: tcmalloc"
    why = f"LD_PRELOAD={os.environ[PRELOAD]!r}" if PRELOAD in os.environ else "no tcmalloc here"
    return f"memory allocator: the C library's malloc ({why})"
