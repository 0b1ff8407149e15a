import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from navit_lightning.batch import IGNORE_LABEL, PAD_ID, PackedShape
from navit_lightning.data.packing import ImageSample, ImageTooLongError, first_fit_decreasing, pack

PATCH_DIM = 4 * 4 * 3


def make_sample(grid_h: int, grid_w: int, label: int, seed: int) -> ImageSample:
    generator = torch.Generator().manual_seed(seed)
    n = grid_h * grid_w
    ys, xs = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()], 1)
    patches = torch.randint(0, 256, (n, PATCH_DIM), dtype=torch.uint8, generator=generator)
    return ImageSample(patches, coords, (grid_h, grid_w), label)


grids = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=0, max_size=20)


@settings(max_examples=60, deadline=None)
@given(grids=grids, rows=st.integers(1, 4), row_len=st.integers(36, 64), max_images=st.integers(1, 6))
def test_every_placed_token_lands_once_with_consistent_fields(grids, rows, row_len, max_images):
    shape = PackedShape(rows, row_len, max_images)
    samples = [make_sample(h, w, label=i, seed=i) for i, (h, w) in enumerate(grids)]
    placed_rows, _ = first_fit_decreasing([len(s.patches) for s in samples], shape)
    placed = [samples[pos] for row in placed_rows for pos in row]
    batch = pack(placed, shape, PATCH_DIM)

    assert batch.patches.shape == (rows, row_len, PATCH_DIM)
    assert batch.num_images == len(placed)
    assert batch.num_real_tokens == sum(len(s.patches) for s in placed)
    seen_labels = []
    for r in range(rows):
        ids = batch.image_ids[r]
        real = ids != PAD_ID
        # Padding only at the end of a row.
        assert not real[int(real.sum()) :].any()
        for slot in range(max_images):
            label = int(batch.labels[r, slot])
            tokens = ids == slot
            if label == IGNORE_LABEL:
                assert not tokens.any() and batch.grid[r, slot].tolist() == [0, 0]
                continue
            sample = samples[label]
            seen_labels.append(label)
            assert batch.grid[r, slot].tolist() == list(sample.grid)
            assert torch.equal(batch.patches[r, tokens], sample.patches)
            assert torch.equal(batch.coords[r, tokens], sample.coords)
    assert sorted(seen_labels) == sorted(int(s.label) for s in placed)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), max_size=40), rows=st.integers(1, 4), max_images=st.integers(1, 5)
)
def test_first_fit_decreasing_respects_capacity_and_repacks_its_own_selection(lengths, rows, max_images):
    shape = PackedShape(rows, 40, max_images)
    placed_rows, left_over = first_fit_decreasing(lengths, shape)
    placed = [pos for row in placed_rows for pos in row]
    assert sorted(placed + left_over) == list(range(len(lengths)))
    for row in placed_rows:
        assert sum(lengths[p] for p in row) <= shape.row_len and len(row) <= max_images
    # The collate packs exactly the sampler's selection again: all of it must fit.
    again, again_left = first_fit_decreasing([lengths[p] for p in placed], shape)
    assert again_left == []
    assert [[placed[p] for p in row] for row in again] == placed_rows


def reference_first_fit_decreasing(
    lengths: list[int], shape: PackedShape
) -> tuple[list[list[int]], list[int]]:
    """first_fit_decreasing as it was first written: one item at a time, each into the first
    row with room. Plans, and the plan digests in checkpoints, came from this."""
    free_tokens = [shape.row_len] * shape.rows
    rows: list[list[int]] = [[] for _ in range(shape.rows)]
    left_over = []
    for pos in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next(
            (
                r
                for r in range(shape.rows)
                if free_tokens[r] >= lengths[pos] and len(rows[r]) < shape.max_images
            ),
            None,
        )
        if row is None:
            left_over.append(pos)
        else:
            rows[row].append(pos)
            free_tokens[row] -= lengths[pos]
    return rows, sorted(left_over)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), max_size=80),
    rows=st.integers(1, 6),
    row_len=st.integers(40, 100),
    max_images=st.integers(1, 8),
)
def test_first_fit_decreasing_places_as_one_item_at_a_time(lengths, rows, row_len, max_images):
    shape = PackedShape(rows, row_len, max_images)
    assert first_fit_decreasing(lengths, shape) == reference_first_fit_decreasing(lengths, shape)


def test_image_longer_than_a_row_is_refused():
    with pytest.raises(ImageTooLongError, match=r"raise data\.row_len"):
        first_fit_decreasing([10, 65], PackedShape(2, 64, 4))


def test_pack_refuses_samples_that_do_not_fit():
    samples = [make_sample(4, 4, 0, 0), make_sample(4, 4, 1, 1)]
    with pytest.raises(ValueError, match="do not fit"):
        pack(samples, PackedShape(1, 20, 4), PATCH_DIM)


def test_empty_batch_is_all_padding():
    batch = pack([], PackedShape(2, 8, 3), PATCH_DIM)
    assert batch.patches.shape == (2, 8, PATCH_DIM)
    assert batch.num_images == 0 and batch.num_real_tokens == 0
