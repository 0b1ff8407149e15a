"""Token-budget batching: how big each image is this epoch, and which images go into each
packed batch, on each rank."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler

from navit_lightning.batch import PackedShape
from navit_lightning.data.packing import first_fit_decreasing_flat
from navit_lightning.data.transforms import fit_grids
from navit_lightning.errors import ConfigError, DataError


class SampleKey(NamedTuple):
    """What the sampler asks the dataset for: image `index` resized to at most
    `max_patches` patches, of which `keep` are kept (the others dropped); `seed` drives the
    image's other random choices this epoch (which tokens it keeps, its flip)."""

    index: int
    max_patches: int
    keep: int
    seed: int


class SampleKeys(NamedTuple):
    """One epoch's SampleKeys of all the images, as columns in index order: a SampleKey
    object is made only for the images of a batch that is handed out."""

    max_patches: np.ndarray  # (images,) int64
    keep: np.ndarray  # (images,) int64
    seed: np.ndarray  # (images,) int64

    def take(self, indices: np.ndarray) -> list[SampleKey]:
        """The keys of images `indices`, (n,) int64, in that order."""
        columns = (self.max_patches[indices], self.keep[indices], self.seed[indices])
        return list(map(SampleKey, indices.tolist(), *(column.tolist() for column in columns)))

    def table(self, indices: np.ndarray) -> np.ndarray:
        """(n, 4) int64 rows of (index, max_patches, keep, seed) of images `indices`."""
        return np.stack([indices, self.max_patches[indices], self.keep[indices], self.seed[indices]], 1)


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
            raise ConfigError(
                f"data.min_patches={self.min_patches} must be between 1 and "
                f"data.max_patches={self.max_patches}"
            )
        if not 0.0 <= self.drop_rate < 1.0:
            raise ConfigError(f"data.token_drop_rate={self.drop_rate} must be in [0, 1)")
        beta = self.drop_beta
        if beta is not None:
            if (
                not isinstance(beta, Sequence)
                or len(beta) != 2
                or not all(isinstance(shape, int | float) and shape > 0 for shape in beta)
            ):
                raise ConfigError(
                    f"data.token_drop_beta={beta} must be the two positive shapes (a, b) of a "
                    "Beta distribution, e.g. data.token_drop_beta=[2,8], or null"
                )
            object.__setattr__(self, "drop_beta", tuple(beta))  # frozen: hashed, compared

    def keys(self, sizes: np.ndarray, seed: int, epoch: int) -> SampleKeys:
        """Every image's key, in index order; `sizes` is (images, 2) (height, width).

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
        grid_h, grid_w = fit_grids(sizes[:, 0], sizes[:, 1], self.patch_size, budgets)
        patches = grid_h * grid_w
        if self.drop_by_resolution:
            rates = rates * (patches / self.max_patches)
        # np.rint rounds half to even, as Python's round did when this was a loop
        keep = np.maximum(1, np.rint(patches * (1 - rates))).astype(np.int64)
        return SampleKeys(budgets, keep, image_seeds)


class EpochOrder(Sampler[int]):
    """All indices, shuffled by (seed, epoch) when shuffle is on; Lightning calls set_epoch."""

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """(size,) int64, the order of `epoch` (this one by default)."""
        if not self.shuffle:
            return np.arange(self.size)
        generator = torch.Generator().manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(self.size, generator=generator).numpy()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.size


class Batches(NamedTuple):
    """Batches of images as two arrays: batch b is images[bounds[b]:bounds[b + 1]]."""

    images: np.ndarray  # (images,) int64 indices, batch after batch
    bounds: np.ndarray  # (batches + 1,) int64 offsets into images, from 0 to len(images)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def sums(self, values: np.ndarray) -> np.ndarray:
        """(batches,) the sum of (images,) `values`, by index, over each batch's images."""
        running = np.concatenate([[0], np.cumsum(values[self.images])])
        return running[self.bounds[1:]] - running[self.bounds[:-1]]


def plan_batches(lengths: np.ndarray, order: np.ndarray, shape: PackedShape, lookahead: int) -> Batches:
    """Group indices (in (images,) `order`) into batches that fit `shape`, by (images,)
    token `lengths`: first-fit-decreasing over a look-ahead buffer of `lookahead` images, or
    of as many as a batch has slots for if that is more (a batch holds no more images than
    the buffer: 128 rows of small images were 60 % full at the default 512); images that do
    not fit wait for the next batch, ahead of those that come after them."""
    lookahead = max(lookahead, shape.rows * shape.max_images)
    images = np.empty(len(order), dtype=np.int64)
    bounds = [0]
    buffer, upcoming = order[:lookahead], lookahead
    while len(buffer):
        placed, _, left_over = first_fit_decreasing_flat(lengths[buffer], shape)
        start = bounds[-1]
        images[start : start + len(placed)] = buffer[placed]
        bounds.append(start + len(placed))
        refill = order[upcoming : upcoming + lookahead - len(left_over)]
        upcoming += len(refill)
        buffer = np.concatenate([buffer[left_over], refill])
    return Batches(images, np.array(bounds, dtype=np.int64))


class _EpochPlan:
    """One epoch's batches over all ranks, and a digest that tells this plan from another."""

    def __init__(self, epoch: int, keys: SampleKeys, batches: Batches) -> None:
        self.epoch = epoch
        self.keys = keys
        self.batches = batches
        self._digest: str | None = None

    def batch(self, number: int) -> list[SampleKey]:
        """The keys of batch `number`, made now: the plan holds them as columns."""
        bounds = self.batches.bounds
        return self.keys.take(self.batches.images[bounds[number] : bounds[number + 1]])

    @property
    def digest(self) -> str:
        # sha256 over the batch ends, then every key's (index, max_patches, keep, seed) in
        # plan order, as int64: the bytes that plans hashed when they were lists of keys, so
        # that checkpoints taken then still resume. Hashed in chunks to bound the memory.
        if self._digest is None:
            hasher = hashlib.sha256(self.batches.bounds[1:].tobytes())
            images = self.batches.images
            for start in range(0, len(images), _DIGEST_CHUNK):
                hasher.update(self.keys.table(images[start : start + _DIGEST_CHUNK]).tobytes())
            self._digest = hasher.hexdigest()
        return self._digest


_DIGEST_CHUNK = 1 << 20  # images: 32 MiB of key rows at a time


class _Resumed(NamedTuple):
    """Where `PackedBatchSampler.resume` put an epoch: its batches from `start` on, or, where
    its batches were done but the trainer had not ended it, none, its length kept."""

    epoch: int
    start: int
    kept_length: int | None = None


class PlanStats(NamedTuple):
    batches: int
    images_per_batch: float
    fill: float  # real tokens / (rows x row_len), over all the batches
    fill_but_last: float  # without the filler batches and the last, which takes what is left
    epoch_images: int


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
        sizes: Sequence[tuple[int, int]] | np.ndarray,
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
        self.sizes = _size_array(sizes)
        self.shape = shape
        self.policy = policy
        self.seed = seed
        self.lookahead = lookahead
        self.num_replicas = num_replicas
        self.rank = rank
        self.sampler = EpochOrder(len(self.sizes), shuffle, seed)  # Lightning calls set_epoch on it
        self._plan: _EpochPlan | None = None
        self._resumed: _Resumed | None = None

    def _epoch_plan(self) -> _EpochPlan:
        epoch = self.sampler.epoch
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = self._plan_of(epoch)
        return self._plan

    def _plan_of(self, epoch: int) -> _EpochPlan:
        keys = self.policy.keys(self.sizes, self.seed, epoch)
        batches = plan_batches(keys.keep, self.sampler.indices(epoch), self.shape, self.lookahead)
        return _EpochPlan(epoch, keys, batches)

    def _per_rank(self, plan: _EpochPlan) -> int:
        return -(-len(plan.batches) // self.num_replicas)

    def _rank_batches(self) -> range:
        """This rank's batch numbers in the epoch's plan, dealt round-robin."""
        return range(self.rank, len(self._epoch_plan().batches), self.num_replicas)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        # The batches are chosen here, not as the iterator advances: Lightning sets the epoch
        # after the loader's iterator exists (FitLoop.setup_data before on_advance_start).
        # A DataLoader calls iter() twice for one pass: the skip holds for the whole epoch.
        resumed = self._resumed_here()
        if resumed is None:
            self._resumed = None  # its epoch is over
        elif resumed.kept_length is not None:
            return iter(())
        start = resumed.start if resumed else 0
        return _dealt(self._epoch_plan(), self._rank_batches(), start, len(self))

    def __len__(self) -> int:
        resumed = self._resumed_here()
        if resumed is not None and resumed.kept_length is not None:
            return resumed.kept_length
        return self._per_rank(self._epoch_plan())

    def coming_length(self) -> int:
        """Each rank's batches of the epoch to train next, at this sampler's settings: the
        current one's (its length), or after an epoch resumed past its batches (see resume,
        whose length is the checkpoint's), the one after it."""
        resumed = self._resumed_here()
        if resumed is None or resumed.kept_length is None:
            return len(self)
        return self._per_rank(self._plan_of(self.sampler.epoch + 1))

    def _resumed_here(self) -> _Resumed | None:
        """The resume's state while its epoch is the current one."""
        resumed = self._resumed
        return resumed if resumed is not None and resumed.epoch == self.sampler.epoch else None

    def position(self, batches_done: int, epoch_ended: bool = False) -> dict[str, Any]:
        """Where training is: `batches_done` of this epoch's batches on every rank (the same
        count on all of them), what identifies the plan they came from, and whether the
        trainer has ended the epoch (after its batches, its validation may be to come)."""
        return {
            "epoch": self.sampler.epoch,
            "batches_done": batches_done,
            "batches_per_rank": len(self),
            "ranks": self.num_replicas,
            "plan": self._epoch_plan().digest,
            "epoch_ended": epoch_ended,
        }

    def resume(self, position: Mapping[str, Any]) -> None:
        """Continue from `position` (see `position`): the rest of its epoch, or the next
        epoch where the trainer had ended it. Mid-epoch, the plan and the rank count must be
        the same. An epoch whose batches are done but which the trainer had not ended (a
        stop in its last validation, which Lightning runs again) gives no batch and keeps
        its length: the next epoch's plan was taken for its rest, whose first batches were
        trained twice where the two plans' lengths differed."""
        epoch, done = position["epoch"], position["batches_done"]
        if done >= position["batches_per_rank"] and position.get("epoch_ended", True):
            self.sampler.set_epoch(epoch + 1)  # (positions saved before the key: an epoch's end)
            return
        self.sampler.set_epoch(epoch)
        if done >= position["batches_per_rank"]:
            self._resumed = _Resumed(epoch, done, kept_length=position["batches_per_rank"])
            return
        refuse_other_ranks(position, self.num_replicas)
        if position["plan"] != self._epoch_plan().digest:
            raise DataError(
                f"{stopped_at(position)}, planned from other data (the images under data.root, or the "
                f"data.* or seed settings, changed since): resume with the same ones, {RESUME_AT_EPOCH_END}"
            )
        self._resumed = _Resumed(epoch, done)

    def plan_stats(self) -> PlanStats:
        """The current epoch's plan, the same on every rank: its batches on each rank, and
        over every rank's batches (a rank's filler batch holds no image) how many images
        they hold and how full they are."""
        plan = self._epoch_plan()
        batches = self._per_rank(plan)
        dealt = max(1, batches * self.num_replicas)
        real = plan.batches.sums(plan.keys.keep)  # (batches of the plan,) tokens
        capacity = self.shape.rows * self.shape.row_len
        but_last = real[:-1] if len(real) > 1 else real
        return PlanStats(
            batches,
            len(plan.batches.images) / dealt,
            float(real.sum()) / (dealt * capacity),
            float(but_last.sum()) / (max(1, len(but_last)) * capacity),
            len(plan.batches.images),
        )


def _dealt(plan: _EpochPlan, mine: range, start: int, count: int) -> Iterator[list[SampleKey]]:
    """A rank's batches `start`..`count` of the plan: its batches `mine`, then empty ones."""
    for position in range(start, count):
        yield plan.batch(mine[position]) if position < len(mine) else []


def _size_array(sizes: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """(images, 2) int64 (height, width); from a list of pairs without a Python object per number."""
    if isinstance(sizes, np.ndarray):
        return np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    return np.fromiter(chain.from_iterable(sizes), dtype=np.int64, count=2 * len(sizes)).reshape(-1, 2)


RESUME_AT_EPOCH_END = (
    "or resume from a checkpoint taken at the end of an epoch (checkpoints/epoch_*.ckpt where "
    "trainer.val_check_interval is 1.0)"
)


def stopped_at(position: Mapping[str, Any]) -> str:
    return f"the checkpoint stopped after batch {position['batches_done']} of epoch {position['epoch']}"


def refuse_other_ranks(position: Mapping[str, Any], ranks: int) -> None:
    """A training `position` (TrainLoader.state_dict) from inside an epoch resumes on its own
    number of ranks alone: the epoch's plan dealt its batches to them. train.py asks before
    the ranks start, which would each refuse it."""
    if position["batches_done"] < position["batches_per_rank"] and position["ranks"] != ranks:
        raise DataError(
            f"{stopped_at(position)} on {position['ranks']} rank(s), this run has {ranks}: resume on "
            f"{position['ranks']} (trainer.devices x trainer.num_nodes), {RESUME_AT_EPOCH_END}"
        )
