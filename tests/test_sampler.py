import random

import pytest

from navit_lightning.data.packing import PackedShape
from navit_lightning.data.sampler import PackedBatchSampler, SampleKey, SizePolicy
from navit_lightning.data.transforms import fit_grid

SHAPE = PackedShape(rows=4, row_len=64, max_images=8)
FIXED = SizePolicy(patch_size=8, max_patches=64)
VARIABLE = SizePolicy(patch_size=8, max_patches=64, min_patches=4, drop_beta=(2.0, 6.0))


def image_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(4, 300), rng.randint(4, 300)) for _ in range(n)]


def rank_batches(sizes, world: int, epoch: int, policy=VARIABLE, shuffle=True) -> list[list[list[SampleKey]]]:
    per_rank = []
    for rank in range(world):
        sampler = PackedBatchSampler(
            sizes, SHAPE, policy, shuffle=shuffle, seed=3, lookahead=64, num_replicas=world, rank=rank
        )
        sampler.sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
        assert len(sampler) == len(per_rank[-1])
    return per_rank


@pytest.mark.parametrize("policy", [FIXED, VARIABLE], ids=["fixed", "variable"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 200])
def test_each_image_once_per_epoch_and_equal_batch_counts(policy, world, n):
    sizes = image_sizes(n)
    per_rank = rank_batches(sizes, world, epoch=0, policy=policy)
    assert len({len(batches) for batches in per_rank}) == 1
    seen = [key.index for batches in per_rank for batch in batches for key in batch]
    assert sorted(seen) == list(range(n))
    for batches in per_rank:
        for batch in batches:
            assert sum(key.keep for key in batch) <= SHAPE.rows * SHAPE.row_len


def test_every_rank_plans_the_same_sizes():
    sizes = image_sizes(300)
    one_rank = {
        key.index: key for (batches,) in [rank_batches(sizes, 1, epoch=2)] for b in batches for key in b
    }
    four_ranks = {key.index: key for batches in rank_batches(sizes, 4, epoch=2) for b in batches for key in b}
    assert one_rank == four_ranks


def test_keys_follow_the_policy():
    sizes = image_sizes(500)
    keys = VARIABLE.keys(sizes, range(len(sizes)), random.Random(0))
    budgets = {key.max_patches for key in keys}
    assert min(budgets) == 4 and max(budgets) == 64
    patches = [fit_grid(*sizes[k.index], 8, k.max_patches) for k in keys]
    assert all(1 <= k.keep <= h * w for k, (h, w) in zip(keys, patches, strict=True))
    dropped = sum(h * w - k.keep for k, (h, w) in zip(keys, patches, strict=True)) / sum(
        h * w for h, w in patches
    )
    assert 0.15 < dropped < 0.35  # Beta(2, 6) has mean 0.25

    full = [fit_grid(*size, 8, 64) for size in sizes[:50]]
    constant = SizePolicy(patch_size=8, max_patches=64, drop_rate=0.5).keys(
        sizes, range(50), random.Random(0)
    )
    assert all(k.keep == max(1, round(h * w * 0.5)) for k, (h, w) in zip(constant, full, strict=True))
    by_resolution = SizePolicy(patch_size=8, max_patches=64, drop_rate=0.5, drop_by_resolution=True)
    for k, (h, w) in zip(by_resolution.keys(sizes, range(50), None), full, strict=True):
        assert k.keep == max(1, round(h * w * (1 - 0.5 * h * w / 64)))
    assert all(
        k.max_patches == 64 and k.keep == h * w
        for k, (h, w) in zip(FIXED.keys(sizes, range(50), None), full, strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_patches": 0}, "min_patches"),
        ({"min_patches": 65}, "min_patches"),
        ({"drop_rate": 1.0}, "token_drop_rate"),
    ],
)
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SizePolicy(patch_size=8, max_patches=64, **kwargs)


def test_set_epoch_reshuffles_and_redraws_deterministically():
    sizes = image_sizes(300)
    assert rank_batches(sizes, 2, epoch=1) == rank_batches(sizes, 2, epoch=1)
    assert rank_batches(sizes, 2, epoch=1) != rank_batches(sizes, 2, epoch=2)
    unshuffled = [rank_batches(sizes, 2, epoch=e, policy=FIXED, shuffle=False) for e in (1, 2)]
    assert unshuffled[0] == unshuffled[1]


def test_variable_sizes_fill_the_batches():
    (batches,) = rank_batches(image_sizes(3000), 1, epoch=0)
    # The last few batches take what is left of the epoch.
    fills = [sum(key.keep for key in batch) / (SHAPE.rows * SHAPE.row_len) for batch in batches[:-3]]
    assert sum(fills) / len(fills) > 0.98 and min(fills) > 0.9, fills
