"""Token-budget batching: how big each image is this epoch, and which images go into each
packed batch, on each rank."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import torch
from torch.utils.data import Sampler

from navit_lightning.data.packing import PackedShape, first_fit_decreasing
from navit_lightning.data.transforms import fit_grid


class SampleKey(NamedTuple):
    """What the sampler asks the dataset for: image `index` resized to at most
    `max_patches` patches, of which `keep` are kept (the others dropped)."""

    index: int
    max_patches: int
    keep: int


@dataclass(frozen=True)
class SizePolicy:
    """How big each image is in one epoch, decided before packing so that the packer knows
    every image's token count, and dropped tokens make room for more images.

    The patch budget is drawn uniformly from [min_patches, max_patches] per image and epoch
    (NaViT's variable-resolution training), or is max_patches when min_patches is None.
    The token-drop rate is drop_rate, or drawn from Beta(*drop_beta) per image; with
    drop_by_resolution it is further scaled by the image's patches / max_patches, so that
    large images lose the most and small ones almost nothing.
    """

    patch_size: int
    max_patches: int
    min_patches: int | None = None
    drop_rate: float = 0.0
    drop_beta: tuple[float, float] | None = None
    drop_by_resolution: bool = False

    def __post_init__(self) -> None:
        if self.min_patches is not None and not 1 <= self.min_patches <= self.max_patches:
            raise ValueError(
                f"data.min_patches={self.min_patches} must be between 1 and "
                f"data.max_patches={self.max_patches}"
            )
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"data.token_drop_rate={self.drop_rate} must be in [0, 1)")

    def keys(
        self, sizes: Sequence[tuple[int, int]], order: Sequence[int], rng: random.Random
    ) -> list[SampleKey]:
        """One key per index in `order`; `sizes` are the images' (height, width)."""
        keys = []
        for index in order:
            budget = (
                self.max_patches
                if self.min_patches is None
                else rng.randint(self.min_patches, self.max_patches)
            )
            grid_h, grid_w = fit_grid(*sizes[index], self.patch_size, budget)
            patches = grid_h * grid_w
            rate = rng.betavariate(*self.drop_beta) if self.drop_beta else self.drop_rate
            if self.drop_by_resolution:
                rate *= patches / self.max_patches
            keys.append(SampleKey(index, budget, max(1, round(patches * (1 - rate)))))
        return keys


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
    fill: float  # real tokens / (rows x row_len), over all the batches
    fill_but_last: float  # the same without the epoch's last batch, which takes what is left


class PackedBatchSampler(Sampler[list[SampleKey]]):
    """Yields this rank's batches of SampleKeys; every rank gets the same number of batches.

    The whole epoch (order, sizes, token drops, batches) is planned identically on every
    rank from (seed, epoch), then batches are dealt round-robin; ranks left one short get an
    empty batch (all padding), so each image is seen exactly once per epoch and no rank
    waits for a step that never comes.
    """

    def __init__(
        self,
        sizes: Sequence[tuple[int, int]],
        shape: PackedShape,
        policy: SizePolicy,
        shuffle: bool,
        seed: int = 0,
        lookahead: int = 512,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.sizes = list(sizes)
        self.shape = shape
        self.policy = policy
        self.seed = seed
        self.lookahead = lookahead
        self.num_replicas = num_replicas
        self.rank = rank
        self.sampler = EpochOrder(len(self.sizes), shuffle, seed)  # Lightning calls set_epoch on it
        self._plan: tuple[int, list[list[SampleKey]]] | None = None

    def _rank_batches(self) -> list[list[SampleKey]]:
        epoch = self.sampler.epoch
        if self._plan is None or self._plan[0] != epoch:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            keys = self.policy.keys(self.sizes, list(self.sampler), rng)
            batches = plan_batches([key.keep for key in keys], range(len(keys)), self.shape, self.lookahead)
            per_rank = -(-len(batches) // self.num_replicas)
            mine = [[keys[pos] for pos in batch] for batch in batches[self.rank :: self.num_replicas]]
            self._plan = (epoch, mine + [[]] * (per_rank - len(mine)))
        return self._plan[1]

    def __iter__(self) -> Iterator[list[SampleKey]]:
        return iter(self._rank_batches())

    def __len__(self) -> int:
        return len(self._rank_batches())

    def plan_stats(self) -> PlanStats:
        """This rank's batches of the current epoch: how many, how many images, how full."""
        batches = self._rank_batches()
        tokens = [sum(key.keep for key in batch) for batch in batches]
        capacity = self.shape.rows * self.shape.row_len
        images = sum(len(batch) for batch in batches)
        but_last = tokens[:-1] or tokens
        return PlanStats(
            len(batches),
            images / max(1, len(batches)),
            sum(tokens) / (max(1, len(tokens)) * capacity),
            sum(but_last) / (max(1, len(but_last)) * capacity),
        )
