"""Which gang sizes can train a job: the arithmetic of an elastic SFTJob's sizes. Pure.

A gang of `n` pods runs `n * processesPerNode` ranks, arranged as data-parallel x
sequence-parallel; the global batch (`data.trainBatchSize`) never changes with the size, so
it must split into whole micro-batches over the data-parallel ranks. The CRD checks this at
`resources.nodes` and `resources.minNodes`; a size between them that does not divide is
skipped (never started).
"""
from __future__ import annotations

from sftjob_contract.sections import batch_splits

from . import api


def min_nodes(spec: api.SFTJobSpec) -> int:
    """The smallest gang the job may run at (`resources.minNodes`, default: `nodes`)."""
    res = spec.resources
    return res.nodes if res.min_nodes is None else min(res.min_nodes, res.nodes)


def misfit(spec: api.SFTJobSpec, nodes: int) -> str | None:
    """Why a gang of `nodes` pods cannot train this job, naming the fields; None if it can."""
    world = nodes * spec.resources.processes_per_node
    sp = spec.training.sequence_parallel_size
    if world % sp:
        return (f"spec.training.sequenceParallelSize ({sp}) must divide the world size at {nodes} node(s) "
                f"({world} = nodes * spec.resources.processesPerNode)")
    micro = spec.data.micro_batch_size_per_gpu
    if not batch_splits(spec.data.train_batch_size, micro, world // sp):
        return (f"spec.data.trainBatchSize ({spec.data.train_batch_size}) must be a multiple of "
                f"spec.data.microBatchSizePerGpu ({micro}) times the data-parallel size at {nodes} node(s) "
                f"({world // sp} = world size {world} / sequenceParallelSize {sp})")
    return None


def allowed(spec: api.SFTJobSpec) -> list[int]:
    """The sizes the job may run at, largest first: minNodes..nodes, skipping misfits."""
    return [n for n in range(spec.resources.nodes, min_nodes(spec) - 1, -1) if misfit(spec, n) is None]


def largest_within(spec: api.SFTJobSpec, limit: int) -> int | None:
    """The largest allowed size of at most `limit` pods (None: not even minNodes fits)."""
    return next((n for n in allowed(spec) if n <= limit), None)


def next_smaller(spec: api.SFTJobSpec, nodes: int) -> int | None:
    """The next allowed size below `nodes` (None: `nodes` is already the smallest)."""
    return largest_within(spec, nodes - 1)
