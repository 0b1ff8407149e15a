"""Token-budget batching: how big each image is this epoch, and which images go into each
packed batch, on each rank."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler

from navit_lightning.data.packing import PackedShape, first_fit_decreasing
from navit_lightning.data.transforms import fit_grid
from navit_lightning.errors import DataError


class SampleKey(NamedTuple):
    """What the sampler asks the dataset for: image `index` resized to at most
    `max_patches` patches, of which `keep` are kept (the others dropped); `seed` drives the
    image's other random choices this epoch (which tokens it keeps, its flip)."""

    index: int
    max_patches: int
    keep: int
    seed: int


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

    def keys(self, sizes: Sequence[tuple[int, int]], seed: int, epoch: int) -> list[SampleKey]:
        """One key per image, in index order; `sizes` are the images' (height, width).

        Each draw for image i is the i-th of a stream seeded by (seed, epoch): it depends on
        nothing else, not on the shuffled order, the ranks, or which loader worker reads the
        image, so a resumed run or one with other data.num_workers sees the same inputs.
        """
        count = len(sizes)
        budget_rng, rate_rng, seed_rng = map(
            np.random.default_rng, np.random.SeedSequence([seed, epoch]).spawn(3)
        )
        if self.min_patches is None:
            budgets = np.full(count, self.max_patches)
        else:
            budgets = budget_rng.integers(self.min_patches, self.max_patches, size=count, endpoint=True)
        rates = (
            rate_rng.beta(*self.drop_beta, size=count) if self.drop_beta else np.full(count, self.drop_rate)
        )
        image_seeds = seed_rng.integers(0, 2**63 - 1, size=count)
        keys = []
        for index, (size, budget, rate, image_seed) in enumerate(
            zip(sizes, budgets.tolist(), rates.tolist(), image_seeds.tolist(), strict=True)
        ):
            grid_h, grid_w = fit_grid(*size, self.patch_size, budget)
            patches = grid_h * grid_w
            if self.drop_by_resolution:
                rate *= patches / self.max_patches
            keys.append(SampleKey(index, budget, max(1, round(patches * (1 - rate))), image_seed))
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


class _EpochPlan:
    """One epoch's batches over all ranks, and a digest that tells this plan from another."""

    def __init__(self, epoch: int, batches: list[list[SampleKey]]) -> None:
        self.epoch = epoch
        self.batches = batches
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            boundaries = np.cumsum([len(batch) for batch in self.batches])
            keys = np.array([key for batch in self.batches for key in batch], dtype=np.int64)
            self._digest = hashlib.sha256(boundaries.tobytes() + keys.tobytes()).hexdigest()
        return self._digest


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

    It resumes mid-epoch: `position(batches_done)` says where every rank is in which epoch's
    plan, and `resume(position)` makes the next iteration continue right after it.
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
        self._plan: _EpochPlan | None = None
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches to skip)

    def _epoch_plan(self) -> _EpochPlan:
        epoch = self.sampler.epoch
        if self._plan is None or self._plan.epoch != epoch:
            keys = self.policy.keys(self.sizes, self.seed, epoch)
            batches = plan_batches([key.keep for key in keys], list(self.sampler), self.shape, self.lookahead)
            self._plan = _EpochPlan(epoch, [[keys[index] for index in batch] for batch in batches])
        return self._plan

    def _rank_batches(self) -> list[list[SampleKey]]:
        batches = self._epoch_plan().batches
        per_rank = -(-len(batches) // self.num_replicas)
        mine = batches[self.rank :: self.num_replicas]
        return mine + [[]] * (per_rank - len(mine))

    def __iter__(self) -> Iterator[list[SampleKey]]:
        # The batches are chosen here, not as the iterator advances: Lightning sets the epoch
        # after the loader's iterator exists (FitLoop.setup_data before on_advance_start).
        # A DataLoader calls iter() twice for one pass: the skip holds for the whole epoch.
        if self._resume_at is not None and self._resume_at[0] != self.sampler.epoch:
            self._resume_at = None
        start = self._resume_at[1] if self._resume_at else 0
        return iter(self._rank_batches()[start:])

    def __len__(self) -> int:
        return len(self._rank_batches())

    def position(self, batches_done: int) -> dict[str, Any]:
        """Where training is: `batches_done` of this epoch's batches on every rank (the same
        count on all of them), and what identifies the plan they came from."""
        return {
            "epoch": self.sampler.epoch,
            "batches_done": batches_done,
            "batches_per_rank": len(self),
            "ranks": self.num_replicas,
            "plan": self._epoch_plan().digest,
        }

    def resume(self, position: Mapping[str, Any]) -> None:
        """Continue from `position` (see `position`): the rest of its epoch, or the next
        epoch if it was over. Mid-epoch, the plan and the rank count must be the same."""
        epoch, done = position["epoch"], position["batches_done"]
        if done >= position["batches_per_rank"]:
            self.sampler.set_epoch(epoch + 1)
            return
        self.sampler.set_epoch(epoch)
        where = f"the checkpoint stopped after batch {done} of epoch {epoch}"
        fix = "or resume from a checkpoint taken at the end of an epoch (checkpoints/epoch_*.ckpt)"
        if position["ranks"] != self.num_replicas:
            raise DataError(
                f"{where} on {position['ranks']} rank(s), this run has {self.num_replicas}: resume on "
                f"{position['ranks']} (trainer.devices x trainer.num_nodes), {fix}"
            )
        if position["plan"] != self._epoch_plan().digest:
            raise DataError(
                f"{where}, planned from other data (the images under data.root, or the data.* or "
                f"seed settings, changed since): resume with the same ones, {fix}"
            )
        self._resume_at = (epoch, done)

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
