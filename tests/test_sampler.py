import hashlib
import math
import random
from itertools import islice

import numpy as np
import pytest

from navit_lightning.batch import PackedShape
from navit_lightning.data.folder import mirrored
from navit_lightning.data.sampler import (
    EpochOrder,
    PackedBatchSampler,
    SampleKey,
    SizePolicy,
    plan_batches,
    refuse_other_ranks,
)
from navit_lightning.data.transforms import fit_grid, fit_grids, longest_side
from navit_lightning.errors import ConfigError, DataError
from tests.test_packing import reference_first_fit_decreasing

SHAPE = PackedShape(rows=4, row_len=64, max_images=8)
FIXED = SizePolicy(patch_size=8, max_patches=64)
VARIABLE = SizePolicy(patch_size=8, max_patches=64, min_patches=4, drop_beta=(2.0, 6.0))


@pytest.mark.parametrize("beta", [[0, 5], [-1, 2], [2], [1, 2, 3], 2, ["a", 1]])
def test_a_token_drop_beta_that_is_not_two_positive_shapes_is_refused(beta):
    """numpy's errors came from setup, with a traceback: `a <= 0`, `beta() takes at least 2
    positional arguments`."""
    with pytest.raises(ConfigError, match=r"data.token_drop_beta=.* must be the two positive shapes"):
        SizePolicy(patch_size=8, max_patches=64, drop_beta=beta)


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


def test_ranks_take_the_plans_batches_in_turn():
    """Rank r trains on batches r, r + R, ... of the one plan every rank makes: blocks of it
    would keep every count above and deal other images to each rank."""
    sizes = image_sizes(200)
    (whole,) = rank_batches(sizes, 1, epoch=0)
    for rank, batches in enumerate(rank_batches(sizes, 3, epoch=0)):
        assert batches[: len(whole[rank::3])] == whole[rank::3]


@pytest.mark.parametrize("world", [1, 3])
def test_plan_stats_are_the_figures_of_every_ranks_batches(world):
    """What training prints and logs as effective_batch/images: 201 images plan 19 batches,
    so 2 of 3 ranks get a filler batch (all padding), a batch of no image; the printed
    average was rank 0's, which got none."""
    capacity = SHAPE.rows * SHAPE.row_len
    samplers = [
        PackedBatchSampler(
            image_sizes(201),
            SHAPE,
            VARIABLE,
            shuffle=True,
            seed=3,
            lookahead=64,
            num_replicas=world,
            rank=rank,
        )
        for rank in range(world)
    ]
    ranks_batches = [list(sampler) for sampler in samplers]
    dealt = [batch for turn in zip(*ranks_batches, strict=True) for batch in turn]  # in the plan's order
    planned = [sum(key.keep for key in batch) for batch in dealt if batch]
    figures = (
        len(ranks_batches[0]),
        sum(map(len, dealt)) / len(dealt),
        sum(planned) / (len(dealt) * capacity),
        sum(planned[:-1]) / ((len(planned) - 1) * capacity),
        201,
    )
    assert sum(not batch for batch in dealt) == (2 if world == 3 else 0)
    assert sum(map(len, dealt)) == 201
    for sampler in samplers:
        assert sampler.plan_stats() == pytest.approx(figures)


def test_every_rank_plans_the_same_sizes():
    sizes = image_sizes(300)
    one_rank = {
        key.index: key for (batches,) in [rank_batches(sizes, 1, epoch=2)] for b in batches for key in b
    }
    four_ranks = {key.index: key for batches in rank_batches(sizes, 4, epoch=2) for b in batches for key in b}
    assert one_rank == four_ranks


def all_keys(policy: SizePolicy, sizes, seed: int = 0, epoch: int = 0) -> list[SampleKey]:
    keys = policy.keys(np.array(sizes).reshape(-1, 2), seed, epoch)
    return keys.take(np.arange(len(sizes)))


def test_keys_follow_the_policy():
    sizes = image_sizes(500)
    keys = all_keys(VARIABLE, sizes)
    budgets = {key.max_patches for key in keys}
    assert min(budgets) == 4 and max(budgets) == 64
    patches = [fit_grid(*sizes[k.index], 8, k.max_patches) for k in keys]
    assert all(1 <= k.keep <= h * w for k, (h, w) in zip(keys, patches, strict=True))
    dropped = sum(h * w - k.keep for k, (h, w) in zip(keys, patches, strict=True)) / sum(
        h * w for h, w in patches
    )
    assert 0.15 < dropped < 0.35  # Beta(2, 6) has mean 0.25

    full = [fit_grid(*size, 8, 64) for size in sizes[:50]]
    constant = all_keys(SizePolicy(patch_size=8, max_patches=64, drop_rate=0.5), sizes[:50])
    assert all(k.keep == max(1, round(h * w * 0.5)) for k, (h, w) in zip(constant, full, strict=True))
    by_resolution = SizePolicy(patch_size=8, max_patches=64, drop_rate=0.5, drop_by_resolution=True)
    for k, (h, w) in zip(all_keys(by_resolution, sizes[:50]), full, strict=True):
        assert k.keep == max(1, round(h * w * (1 - 0.5 * h * w / 64)))
    assert all(
        k.max_patches == 64 and k.keep == h * w
        for k, (h, w) in zip(all_keys(FIXED, sizes[:50]), full, strict=True)
    )


def test_token_dropping_leaves_every_image_a_token():
    """A 1-patch image at drop rate 0.6 rounds to no token: an image that gets a label and a
    slot in the batch but no token to pool."""
    sizes = [[16, 16], [64, 64]]  # 1 patch and 16 patches of 16 px
    keys = all_keys(SizePolicy(patch_size=16, max_patches=64, drop_rate=0.6), sizes)
    assert [key.keep for key in keys] == [1, round(16 * 0.4)]
    beta = SizePolicy(patch_size=16, max_patches=64, drop_beta=(8, 1))  # rates near 1
    assert all(key.keep >= 1 for key in all_keys(beta, [[16, 16]] * 20 + [[64, 64]] * 20))


def scalar_fit_grid(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """fit_grid as it was first written, one image in Python floats."""
    scale = min(1.0, math.sqrt(max_patches * patch_size**2 / (height * width)))
    grid_h = max(1, round(height * scale / patch_size))
    grid_w = max(1, round(width * scale / patch_size))
    while grid_h * grid_w > max_patches:
        if grid_h >= grid_w:
            grid_h -= 1
        else:
            grid_w -= 1
    return grid_h, grid_w


def test_fit_grids_gives_the_scalar_originals_grids():
    rng = np.random.default_rng(0)
    count = 50_000
    # sides from 1 px to 20,000 px, any aspect, budgets from 1 to 1024 patches
    sides = np.exp(rng.uniform(0, np.log(20_000), (count, 2))).astype(np.int64) + 1
    budgets = rng.integers(1, 1024, count, endpoint=True)
    patch_sizes = (8, 14, 16, 32)
    for patch_size in patch_sizes:
        grids = np.stack(fit_grids(sides[:, 0], sides[:, 1], patch_size, budgets), 1)
        expected = [
            scalar_fit_grid(h, w, patch_size, b)
            for (h, w), b in zip(sides.tolist(), budgets.tolist(), strict=True)
        ]
        assert grids.tolist() == [list(grid) for grid in expected]


def test_the_longest_side_over_budgets_is_every_budgets_longest():
    """Not always at the largest budget: a 338 x 25 px image is 2 x 18 patches of 16 px at 36,
    1 x 20 at 30; the setup's check against the position tables took 18, and training met 20."""
    assert longest_side(np.array([25]), np.array([338]), 16, range(12, 37)) == (20, 0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        sides = np.exp(rng.uniform(0, np.log(5_000), (20, 2))).astype(np.int64) + 1
        low = int(rng.integers(1, 200))
        budgets = range(low, low + int(rng.integers(1, 300)))
        patch_size = int(rng.choice([8, 14, 16, 32]))
        each = np.stack(
            [np.maximum(*fit_grids(sides[:, 0], sides[:, 1], patch_size, np.full(20, b))) for b in budgets]
        )  # (budgets, images)
        assert longest_side(sides[:, 0], sides[:, 1], patch_size, budgets) in {
            (each.max(), image) for image in np.flatnonzero(each.max(axis=0) == each.max())
        }


def reference_keys(policy: SizePolicy, sizes, seed: int, epoch: int) -> list[SampleKey]:
    """SizePolicy.keys as it was first written: the same draws, then one image at a time."""
    budget_rng, rate_rng, seed_rng = map(
        np.random.default_rng, np.random.SeedSequence([seed, epoch]).spawn(3)
    )
    count = len(sizes)
    budgets = budget_rng.integers(policy.min_patches, policy.max_patches, size=count, endpoint=True)
    rates = rate_rng.beta(*policy.drop_beta, size=count)
    image_seeds = seed_rng.integers(0, 2**63 - 1, size=count)
    keys = []
    for index, (size, budget, rate, image_seed) in enumerate(
        zip(sizes, budgets.tolist(), rates.tolist(), image_seeds.tolist(), strict=True)
    ):
        grid_h, grid_w = fit_grid(*size, policy.patch_size, budget)
        rate *= grid_h * grid_w / policy.max_patches
        keys.append(SampleKey(index, budget, max(1, round(grid_h * grid_w * (1 - rate))), image_seed))
    return keys


def reference_plan(
    keys: list[SampleKey], order: list[int], shape: PackedShape, lookahead: int
) -> list[list[SampleKey]]:
    """The epoch's batches as they were first planned: lists of keys (with a look-ahead of at
    least a batch's slots since, a setting where plans changed)."""
    lookahead = max(lookahead, shape.rows * shape.max_images)
    batches: list[list[SampleKey]] = []
    buffer: list[int] = []
    upcoming = iter(order)
    while True:
        buffer.extend(islice(upcoming, lookahead - len(buffer)))
        if not buffer:
            return batches
        rows, left_over = reference_first_fit_decreasing([keys[i].keep for i in buffer], shape)
        batches.append([keys[buffer[pos]] for row in rows for pos in row])
        buffer = [buffer[pos] for pos in left_over]


def reference_digest(batches: list[list[SampleKey]]) -> str:
    boundaries = np.cumsum([len(batch) for batch in batches])
    keys = np.array([key for batch in batches for key in batch], dtype=np.int64)
    return hashlib.sha256(boundaries.tobytes() + keys.tobytes()).hexdigest()


@pytest.mark.parametrize("case", range(12))
def test_the_planner_plans_as_it_was_first_written(case):
    """Same batches, same digest: checkpoints taken before the planner was vectorised resume."""
    rng = random.Random(case)
    sizes = image_sizes(rng.randint(0, 3000), seed=case)
    shape = PackedShape(rng.randint(1, 8), rng.randint(64, 200), rng.randint(1, 40))
    max_patches = rng.randint(16, 64)
    policy = SizePolicy(
        patch_size=rng.choice([8, 16]),
        max_patches=max_patches,
        min_patches=rng.randint(1, max_patches),
        drop_beta=(rng.uniform(0.5, 3), rng.uniform(1, 8)),
        drop_by_resolution=True,
    )
    lookahead = rng.randint(1, 600)
    sampler = PackedBatchSampler(sizes, shape, policy, shuffle=True, seed=case, lookahead=lookahead)
    sampler.sampler.set_epoch(case)
    expected = reference_plan(
        reference_keys(policy, sizes, case, case),
        list(EpochOrder(len(sizes), True, case + case)),
        shape,
        lookahead,
    )
    assert list(sampler) == expected
    assert sampler.position(0)["plan"] == reference_digest(expected)


def test_the_plan_digest_is_the_one_checkpoints_hold():
    (sampler,) = samplers(image_sizes(300), 1)
    sampler.sampler.set_epoch(2)
    assert sampler.position(1)["plan"] == "4a3e6bbb113a96a9b3f3a8bd2c03ab06c4d367667f8c2577805e72396e9db9cf"


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


def test_a_budget_range_of_one_budget_is_taken():
    """min_patches may be 1 or max_patches: both ends of the range are allowed."""
    keys = SizePolicy(patch_size=8, max_patches=64, min_patches=64).keys(np.full((50, 2), 200), 0, 0)
    assert (keys.max_patches == 64).all()
    SizePolicy(patch_size=8, max_patches=64, min_patches=1)


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_world_is_refused(rank):
    with pytest.raises(ValueError, match=f"rank {rank} is outside 0..1"):
        PackedBatchSampler(image_sizes(10), SHAPE, FIXED, shuffle=True, num_replicas=2, rank=rank)


def test_set_epoch_reshuffles_and_redraws_deterministically():
    sizes = image_sizes(300)
    assert rank_batches(sizes, 2, epoch=1) == rank_batches(sizes, 2, epoch=1)
    assert rank_batches(sizes, 2, epoch=1) != rank_batches(sizes, 2, epoch=2)
    unshuffled = [rank_batches(sizes, 2, epoch=e, policy=FIXED, shuffle=False) for e in (1, 2)]
    # The same images at the same sizes, with new per-image seeds (new flips) every epoch.
    sized = [[[key[:3] for key in batch] for batches in plan for batch in batches] for plan in unshuffled]
    assert sized[0] == sized[1]
    seeds = [{key.seed for batches in plan for batch in batches for key in batch} for plan in unshuffled]
    assert seeds[0].isdisjoint(seeds[1])


def test_variable_sizes_fill_the_batches():
    (batches,) = rank_batches(image_sizes(3000), 1, epoch=0)
    # The last few batches take what is left of the epoch.
    fills = [sum(key.keep for key in batch) / (SHAPE.rows * SHAPE.row_len) for batch in batches[:-3]]
    assert sum(fills) / len(fills) > 0.98 and min(fills) > 0.9, fills


def test_a_batch_of_more_slots_than_the_look_ahead_is_filled():
    """A batch held no more images than the buffer: 128 rows of small images were 60 % full
    at data.lookahead=512."""
    lengths = np.random.default_rng(0).integers(4, 17, size=20_000)
    shape = PackedShape(rows=64, row_len=64, max_images=16)
    batches = plan_batches(lengths, np.arange(len(lengths)), shape, lookahead=64)
    fills = batches.sums(lengths)[:-3] / (shape.rows * shape.row_len)
    assert fills.mean() > 0.98 and np.diff(batches.bounds).max() > 64


def samplers(sizes, world: int) -> list[PackedBatchSampler]:
    return [
        PackedBatchSampler(
            sizes, SHAPE, VARIABLE, shuffle=True, seed=3, lookahead=64, num_replicas=world, rank=r
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stop", ["first", "second", "middle", "last"])
def test_an_epoch_interrupted_and_resumed_sees_every_image_once(world, stop):
    sizes = image_sizes(300)
    running = samplers(sizes, world)
    for sampler in running:
        sampler.sampler.set_epoch(2)
    whole = [list(sampler) for sampler in running]
    stop = {"first": 0, "second": 1, "middle": len(whole[0]) // 2, "last": len(whole[0]) - 1}[stop]
    position = running[0].position(stop)
    assert all(sampler.position(stop) == position for sampler in running)  # rank 0 saves it for all

    resumed = samplers(sizes, world)  # new processes: their samplers start at epoch 0
    for sampler in resumed:
        sampler.resume(position)
    rest = [list(sampler) for sampler in resumed]
    assert [batches[:stop] + after for batches, after in zip(whole, rest, strict=True)] == whole
    seen = [key.index for batches in whole for batch in batches[:stop] for key in batch]
    seen += [key.index for batches in rest for batch in batches for key in batch]
    assert sorted(seen) == list(range(len(sizes)))
    # Lightning counts the epoch's whole length (it adds the batches it already did).
    assert all(len(sampler) == len(whole[0]) for sampler in resumed)
    for sampler in resumed:
        sampler.sampler.set_epoch(3)
    assert [list(sampler) for sampler in resumed] == rank_batches(sizes, world, epoch=3)


@pytest.mark.parametrize("running_world", [1, 2])
@pytest.mark.parametrize("ended", [True, False])
def test_a_position_at_the_end_of_an_epoch_resumes_on_any_number_of_ranks(running_world, ended):
    """Ended by the trainer, it resumes into the next epoch. Not ended (a stop in its last
    validation, which Lightning runs again and then ends the epoch), it gives no batch and
    keeps the epoch's length: it had the next epoch's plan, of another length, and Lightning
    trained its first batches as the rest. Its batches_done is each rank's count, as is
    batches_per_rank: were that the whole plan's, the epoch would read as unfinished, and
    train.py (which asks before the ranks start) and every rank would refuse another rank
    count."""
    sizes = image_sizes(300)
    running = samplers(sizes, running_world)
    for sampler in running:
        sampler.sampler.set_epoch(5)
    position = running[0].position(len(running[0]), epoch_ended=ended)
    assert len(rank_batches(sizes, running_world, epoch=6)[0]) != position["batches_per_rank"]
    for world in (1, 2, 3):
        refuse_other_ranks(position, world)
        resumed = samplers(sizes, world)  # new processes: their samplers start at epoch 0
        for sampler in resumed:
            sampler.resume(position)
        # the schedule's count of the epochs to come
        coming = len(rank_batches(sizes, world, epoch=6)[0])
        assert all(sampler.coming_length() == coming for sampler in resumed)
        if not ended:
            assert all(list(sampler) == [] for sampler in resumed)
            assert all(len(sampler) == position["batches_per_rank"] for sampler in resumed)
            for sampler in resumed:
                sampler.sampler.set_epoch(6)  # as Lightning sets it when it starts the next
        assert [list(sampler) for sampler in resumed] == rank_batches(sizes, world, epoch=6)


def test_the_fill_of_a_one_batch_epoch_but_its_last_batch_is_that_batchs():
    sampler = PackedBatchSampler(image_sizes(3), SHAPE, FIXED, shuffle=False)
    stats = sampler.plan_stats()
    assert stats.batches == 1 and stats.fill > 0
    assert stats.fill_but_last == stats.fill


def test_resuming_mid_epoch_on_other_ranks_or_data_is_refused():
    sizes = image_sizes(300)
    (running,) = samplers(sizes, 1)
    position = running.position(3)
    (other_ranks, _) = samplers(sizes, 2)
    with pytest.raises(DataError, match=r"after batch 3 of epoch 0 on 1 rank\(s\), this run has 2"):
        other_ranks.resume(position)
    (other_data,) = samplers(sizes[:-1], 1)
    with pytest.raises(DataError, match="planned from other data"):
        other_data.resume(position)


@pytest.mark.parametrize("hflip", [0.0, 0.3, 0.5, 1.0])
def test_the_key_seed_flips_images_at_the_configured_rate(hflip):
    keys = SizePolicy(16, 64).keys(np.full((20_000, 2), 64), seed=3, epoch=1)
    rate = sum(mirrored(seed, hflip) for seed in keys.seed.tolist()) / len(keys.seed)
    assert rate == pytest.approx(hflip, abs=0.015)
    # independent of the draws the seed also drives: the budget
    budgets = SizePolicy(16, 64, min_patches=4).keys(np.full((20_000, 2), 64), seed=3, epoch=1)
    flipped = budgets.max_patches[[mirrored(seed, 0.5) for seed in budgets.seed.tolist()]]
    assert flipped.mean() == pytest.approx(budgets.max_patches.mean(), rel=0.03)
