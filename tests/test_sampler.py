import random

import pytest

from navit_lightning.data.packing import PackedShape
from navit_lightning.data.sampler import PackedBatchSampler

SHAPE = PackedShape(rows=4, row_len=64, max_images=8)


def lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 64) for _ in range(n)]


def rank_batches(sizes: list[int], world: int, epoch: int, shuffle: bool = True) -> list[list[list[int]]]:
    per_rank = []
    for rank in range(world):
        sampler = PackedBatchSampler(
            sizes, SHAPE, shuffle=shuffle, seed=3, lookahead=64, num_replicas=world, rank=rank
        )
        sampler.sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
        assert len(sampler) == len(per_rank[-1])
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 200])
def test_each_image_once_per_epoch_and_equal_batch_counts(world, n):
    sizes = lengths(n)
    per_rank = rank_batches(sizes, world, epoch=0)
    assert len({len(batches) for batches in per_rank}) == 1
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(n))
    for batches in per_rank:
        for batch in batches:
            assert sum(sizes[i] for i in batch) <= SHAPE.rows * SHAPE.row_len


def test_set_epoch_reshuffles_deterministically():
    sizes = lengths(300)
    assert rank_batches(sizes, 2, epoch=1) == rank_batches(sizes, 2, epoch=1)
    assert rank_batches(sizes, 2, epoch=1) != rank_batches(sizes, 2, epoch=2)
    assert rank_batches(sizes, 2, epoch=1, shuffle=False) == rank_batches(sizes, 2, epoch=2, shuffle=False)


def test_batches_are_nearly_full():
    sizes = lengths(2000)
    (batches,) = rank_batches(sizes, 1, epoch=0)
    # The last few batches take what is left of the epoch.
    fills = [sum(sizes[i] for i in batch) / (SHAPE.rows * SHAPE.row_len) for batch in batches[:-3]]
    assert sum(fills) / len(fills) > 0.97 and min(fills) > 0.85, fills
