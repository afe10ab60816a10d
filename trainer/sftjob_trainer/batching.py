"""Batches: samples → micro-batches (packed or padded) in a resumable global order.

A global batch is a slice of the dataset's order (`SFTDataset.epoch_order`, or for weighted
sources `mixing.MixedDataset.epoch_order`, a pure function of seed and epoch) at one global
sample cursor; each rank takes its share of it, so a checkpoint written by N processes
resumes on M processes with the same samples. Packing
groups a rank's samples into rows under a token budget (`token_groups`), and the rows are
spread over the micro-batches of an accumulation (`split_to`). With a token budget the
shares are balanced by tokens (`rank_shares`), since the step waits for the busiest rank;
without one each rank takes a contiguous slice.
"""
from __future__ import annotations

import heapq
import json
import logging
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from sftjob_contract.config import DataConfig
from sftjob_contract.sections import batch_splits

from .data import IGNORE, Sample, SFTDataset
from .mixing import MixedDataset
from .errors import InvalidData

SP_FIELD = "trainer.sequence_parallel_size"
log = logging.getLogger(__name__)

# On a CPU a micro-batch costs about 40 ms beyond its tokens (every weight gradient written
# and added in full), and a narrow model's per-token matmuls are too small to run near the
# peak: 2048 tokens of the bench's 384-wide model ran 1.05-1.18x (length 128) and 1.08-1.14x
# (micro-batch 1) the tokens/s of 512 (bench/README.md, issue 30). So without an explicit
# budget the trainer packs at least this many [tokens, hidden] activation elements into a CPU
# micro-batch: the floor shrinks as the model widens, where the matmuls are big already.
CPU_MIN_ACTIVATION = 2048 * 384


def min_micro_batch_tokens(model_path: str, device: torch.device) -> int:
    """The floor under the default token budget (`DataConfig.token_budget`): on a CPU
    ``CPU_MIN_ACTIVATION / hidden_size`` tokens; on GPUs none (their memory is the user's to size)."""
    if device.type != "cpu":
        return 0
    try:  # config.json as written (no remote code run); a model that cannot load fails in build_model
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = (config.get("text_config") or config) if isinstance(config, dict) else {}
    if not isinstance(config, dict):
        return 0
    hidden = next((config[k] for k in ("hidden_size", "n_embd", "d_model") if k in config), None)  # GPT-2: n_embd
    return -(-CPU_MIN_ACTIVATION // hidden) if isinstance(hidden, int) and hidden > 0 else 0


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    sample_ids: list[int]
    n_tokens: int  # real (non-pad) tokens
    n_targets: int
    seq_lengths: list[int]
    # The full row's sequence boundaries, for a sequence-parallel slice (ulysses.shard_micro_batch).
    cu_seq_lens: torch.Tensor | None = None


def collate(samples: list[Sample], ids: list[int], packing: bool, pad_id: int) -> MicroBatch:
    lengths = [len(s.input_ids) for s in samples]
    if packing:
        # One row, positions restarting per sequence and no attention mask: transformers
        # then builds a block-diagonal causal mask (sdpa) or uses varlen flash-attention.
        input_ids = torch.tensor([[t for s in samples for t in s.input_ids]])
        targets = torch.tensor([[t for s in samples for t in s.targets]])
        position_ids = torch.tensor([[p for n in lengths for p in range(n)]])
        mask = None
    else:
        width = max(lengths)
        input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
        targets = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.input_ids)
            input_ids[i, :n] = torch.tensor(s.input_ids)
            targets[i, :n] = torch.tensor(s.targets)
            mask[i, :n] = 1
        position_ids = torch.arange(width).unsqueeze(0).expand(len(samples), -1).contiguous()
    return MicroBatch(
        input_ids=input_ids,
        targets=targets,
        position_ids=position_ids,
        attention_mask=mask,
        sample_ids=list(ids),
        n_tokens=sum(lengths),
        n_targets=sum(s.n_targets for s in samples),
        seq_lengths=lengths,
    )


class GlobalBatches:
    """The global-cursor schedule: which samples each rank trains on at each step."""

    def __init__(self, dataset: SFTDataset | MixedDataset, cfg: DataConfig, seed: int, rank: int, world: int,
                 pad_id: int, shard: Callable[[MicroBatch], MicroBatch] | None = None, min_tokens: int = 0):
        """``rank``/``world``: the data-parallel ones (with sequence parallelism the ranks of an SP
        group share one); ``shard`` cuts this rank's slice out of each micro-batch (ulysses.py);
        ``min_tokens``: the floor under the default token budget (`min_micro_batch_tokens`)."""
        # With sequence parallelism the batch is split over the SP groups, not the processes.
        what = "processes" if shard is None else f"data-parallel ranks (processes / {SP_FIELD})"
        self.per_rank = cfg.train_batch_size // world
        if not batch_splits(cfg.train_batch_size, cfg.micro_batch_size_per_gpu, world):
            if cfg.train_batch_size % world:
                raise InvalidData(f"data.train_batch_size ({cfg.train_batch_size}) must be divisible by the number "
                                  f"of {what} ({world})")
            raise InvalidData(
                f"data.micro_batch_size_per_gpu ({cfg.micro_batch_size_per_gpu}) must divide the per-rank batch "
                f"({self.per_rank} = data.train_batch_size {cfg.train_batch_size} / {world} {what})"
            )
        self.dataset, self.cfg, self.seed, self.rank, self.world, self.pad_id = dataset, cfg, seed, rank, world, pad_id
        self.shard = shard
        self.budget = cfg.token_budget(min_tokens)
        if cfg.packing and cfg.max_tokens_per_micro_batch is None and self.budget == min_tokens > 0:
            log.info("micro-batches of up to %d tokens: on a CPU the trainer packs at least that many "
                     "(data.micro_batch_size_per_gpu x data.max_length = %d; set data.max_tokens_per_micro_batch "
                     "to choose)", self.budget, cfg.micro_batch_size_per_gpu * cfg.max_length)
        self.global_batch = cfg.train_batch_size
        self.steps_per_epoch = dataset.epoch_size // self.global_batch
        if self.steps_per_epoch == 0:
            raise InvalidData(
                f"train data has {dataset.epoch_size} samples per epoch, fewer than one global batch "
                f"(data.train_batch_size={self.global_batch})"
            )
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = self.dataset.epoch_order(self.seed, epoch, self.cfg.shuffle)
            self._order_epoch = epoch
        return self._order

    def step_ids(self, epoch: int, cursor: int) -> list[int]:
        """The global batch starting at ``cursor``: its sample ids, all ranks together, in order."""
        return self._batch(epoch, cursor).tolist()

    def _batch(self, epoch: int, cursor: int) -> np.ndarray:
        return self.order(epoch)[cursor : cursor + self.global_batch]

    def step_batches(self, epoch: int, cursor: int) -> list[MicroBatch]:
        """The micro-batches of this rank for the global batch starting at ``cursor``."""
        ids = self._batch(epoch, cursor)
        budget = self.budget
        if budget is None:
            m = self.cfg.micro_batch_size_per_gpu
            mine = ids[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
            groups = [mine[k : k + m] for k in range(0, len(mine), m)]
        else:
            # Every rank must run the same number of forwards (FSDP gathers weights in each),
            # and each can count the others' from the shared lengths table: no communication.
            lengths = self.dataset.lengths
            shares = [ids[s] for s in rank_shares(lengths[ids], self.world)]
            mine = shares[self.rank]
            count = max(len(token_groups(lengths[s], budget)) for s in shares)
            groups = [mine[g] for g in split_to(token_groups(lengths[mine], budget), count)]
        out = []
        for group in groups:
            chunk = [int(i) for i in group]
            mb = collate([self.dataset.sample(i) for i in chunk], chunk, self.cfg.packing, self.pad_id)
            out.append(self.shard(mb) if self.shard else mb)
        return out


def rank_shares(lengths: np.ndarray, world: int) -> list[np.ndarray]:
    """Each rank's positions in a global batch whose samples have ``lengths``: the same number
    of samples each, their tokens balanced (longest first, to the rank with the fewest tokens
    that still has room; ties to the lower rank), each share in batch order.

    A pure function of the lengths and the world size, so every rank computes every share
    and a resume at the same size trains the same micro-batches."""
    per = len(lengths) // world
    open_ranks = [(0, r) for r in range(world)]   # (tokens, rank), a heap of ranks with room
    shares: list[list[int]] = [[] for _ in range(world)]
    for pos in np.argsort(-lengths, kind="stable").tolist():
        tokens, r = heapq.heappop(open_ranks)
        shares[r].append(pos)
        if len(shares[r]) < per:
            heapq.heappush(open_ranks, (tokens + int(lengths[pos]), r))
    return [np.array(sorted(s), dtype=np.int64) for s in shares]


def logged_ids(planned: list[int], parts: list[list[int]]) -> list[int]:
    """A step's sample ids for metrics.jsonl (trainer.log_sample_ids) from each rank's ``parts``:
    in the global batch's order (``planned``) at any world size, since packed shares are not
    contiguous, so runs compare step by step across resizes. Ranks that trained anything but
    exactly that batch are logged as an error, and what they trained is what is written."""
    trained = [i for part in parts for i in part]
    if sorted(trained) == sorted(planned):
        return planned
    log.error("trained samples %s, not the step's global batch %s", trained, planned)
    return trained


def token_groups(lengths: np.ndarray, budget: int) -> list[slice]:
    """Consecutive runs of samples whose lengths sum to at most ``budget`` (at least one sample each)."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(int(x) for x in lengths):
        if i > start and used + n > budget:
            groups.append(slice(start, i))
            start, used = i, 0
        used += n
    if len(lengths):
        groups.append(slice(start, len(lengths)))
    return groups


def split_to(groups: list[slice], count: int) -> list[slice]:
    """Split the groups with the most samples in halves until there are ``count`` of them."""
    groups = list(groups)
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: groups[j].stop - groups[j].start)
        g = groups[k]
        if g.stop - g.start < 2:
            raise AssertionError("cannot split a rank's batch into more micro-batches than samples")
        mid = g.start + (g.stop - g.start) // 2
        groups[k : k + 1] = [slice(g.start, mid), slice(mid, g.stop)]
    return groups


def eval_batches(dataset: SFTDataset, micro: int, rank: int, world: int, packing: bool, pad_id: int,
                 shard: Callable[[MicroBatch], MicroBatch] | None = None) -> Iterator[MicroBatch]:
    """This rank's share of the validation set in file order (every usable row once); ``rank``,
    ``world`` and ``shard`` as for `GlobalBatches`."""
    mine = dataset.valid[rank::world]
    for k in range(0, len(mine), micro):
        chunk = [int(i) for i in mine[k : k + micro]]
        mb = collate([dataset.sample(i) for i in chunk], chunk, packing, pad_id)
        yield shard(mb) if shard else mb
