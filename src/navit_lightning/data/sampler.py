"""Token-budget batching: which images go into each packed batch, on each rank."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from typing import NamedTuple

import torch
from torch.utils.data import Sampler

from navit_lightning.data.packing import PackedShape, first_fit_decreasing


class EpochOrder(Sampler[int]):
    """All indices, shuffled by (seed, epoch) when shuffle is on; Lightning calls set_epoch."""

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


def plan_batches(
    lengths: Sequence[int], order: Sequence[int], shape: PackedShape, lookahead: int
) -> list[list[int]]:
    """Group indices (in `order`) into batches that fit `shape`, first-fit-decreasing over a
    look-ahead buffer of `lookahead` images; images that do not fit wait for the next batch."""
    batches: list[list[int]] = []
    buffer: list[int] = []
    upcoming = iter(order)
    while True:
        buffer.extend(islice(upcoming, lookahead - len(buffer)))
        if not buffer:
            return batches
        rows, left_over = first_fit_decreasing([lengths[i] for i in buffer], shape)
        batches.append([buffer[pos] for row in rows for pos in row])
        buffer = [buffer[pos] for pos in left_over]


class PlanStats(NamedTuple):
    batches: int
    images_per_batch: float
    fill: float  # real tokens / (rows x row_len), over the batches


class PackedBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of indices; every rank gets the same number of batches.

    The whole epoch is planned identically on every rank from (seed, epoch), then batches
    are dealt round-robin; ranks left one short get an empty batch (all padding), so each
    image is seen exactly once per epoch and no rank waits for a step that never comes.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        shape: PackedShape,
        shuffle: bool,
        seed: int = 0,
        lookahead: int = 512,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.lengths = list(lengths)
        self.shape = shape
        self.lookahead = lookahead
        self.num_replicas = num_replicas
        self.rank = rank
        self.sampler = EpochOrder(len(self.lengths), shuffle, seed)  # Lightning calls set_epoch on it
        self._plan: tuple[int, list[list[int]]] | None = None

    def _rank_batches(self) -> list[list[int]]:
        epoch = self.sampler.epoch
        if self._plan is None or self._plan[0] != epoch:
            batches = plan_batches(self.lengths, list(self.sampler), self.shape, self.lookahead)
            per_rank = -(-len(batches) // self.num_replicas)
            mine = batches[self.rank :: self.num_replicas]
            self._plan = (epoch, mine + [[]] * (per_rank - len(mine)))
        return self._plan[1]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._rank_batches())

    def __len__(self) -> int:
        return len(self._rank_batches())

    def plan_stats(self) -> PlanStats:
        """This rank's batches of the current epoch: how many, how many images, how full."""
        batches = self._rank_batches()
        images = sum(len(batch) for batch in batches)
        tokens = sum(self.lengths[i] for batch in batches for i in batch)
        capacity = max(1, len(batches)) * self.shape.rows * self.shape.row_len
        return PlanStats(len(batches), images / max(1, len(batches)), tokens / capacity)
