"""Packing variable-size images into fixed-shape batches of rows (Patch n' Pack): the
batches of navit_lightning.batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from navit_lightning.batch import IGNORE_LABEL, PAD_ID, PackedBatch, PackedShape


class ImageTooLongError(ValueError):
    pass


def first_fit_decreasing(
    lengths: Sequence[int] | np.ndarray, shape: PackedShape
) -> tuple[list[list[int]], list[int]]:
    """Place items (by token length) into `shape.rows` rows, largest first (ties in position
    order), each into the first row with room for its tokens and a free slot.

    Returns (rows of item positions, positions that did not fit). The placement of the items
    that fit does not depend on those that did not, so packing exactly the placed items
    again reproduces the same rows.
    """
    placed, row_counts, left_over = first_fit_decreasing_flat(np.asarray(lengths, dtype=np.int64), shape)
    rows = np.split(placed, np.cumsum(row_counts)[:-1])
    return [row.tolist() for row in rows], left_over.tolist()


def first_fit_decreasing_flat(
    lengths: np.ndarray, shape: PackedShape
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """first_fit_decreasing as arrays: (placed item positions row after row, (rows,) items
    per row, ascending positions that did not fit); `lengths` is (items,) int64, each >= 1.

    Items of one length are placed one run at a time: first fit puts each into the first row
    with room, and a row that cannot take one more of them cannot take any later one of that
    length either (rows only fill up), so each row takes as many of the run as fit, in turn.
    That places the same items in the same rows as placing them one by one, in a loop over
    the distinct lengths rather than the items.
    """
    by_length = np.argsort(-lengths, kind="stable")  # (items,) positions, largest first
    longest = int(lengths.max(initial=0))
    if longest > shape.row_len:
        raise ImageTooLongError(
            f"an image of {longest} patches does not fit a row of {shape.row_len} tokens: "
            f"raise data.row_len or lower data.max_patches"
        )
    counts = np.bincount(lengths)  # (longest + 1,) items of each length
    run_lengths = np.flatnonzero(counts)[::-1]  # the distinct lengths, longest first
    piece_rows, piece_counts = _place_runs(run_lengths.tolist(), counts[run_lengths].tolist(), shape)
    # (items,) the row of each item in by_length order; shape.rows for those left over
    row_of = np.repeat(np.array(piece_rows, dtype=np.int64), piece_counts)
    in_row_order = by_length[np.argsort(row_of, kind="stable")]
    row_counts = np.bincount(row_of, minlength=shape.rows + 1)
    placed = len(lengths) - row_counts[shape.rows]
    return in_row_order[:placed], row_counts[: shape.rows], np.sort(in_row_order[placed:])


def _place_runs(lengths: list[int], counts: list[int], shape: PackedShape) -> tuple[list[int], list[int]]:
    """First fit of runs of `counts[i]` items of `lengths[i]` tokens, longest run first:
    (row, items) pieces that cover the runs in order; row shape.rows holds what did not fit."""
    free_tokens = [shape.row_len] * shape.rows
    free_slots = [shape.max_images] * shape.rows
    smallest = lengths[-1] if lengths else 0
    open_rows = list(range(shape.rows))  # rows that can still take the smallest item
    piece_rows: list[int] = []
    piece_counts: list[int] = []
    for run, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        if not open_rows:  # the batch is full: the rest waits
            piece_rows.append(shape.rows)
            piece_counts.append(sum(counts[run:]))
            break
        left = count
        for row in open_rows:
            taken = min(left, free_tokens[row] // length, free_slots[row])
            if taken:
                piece_rows.append(row)
                piece_counts.append(taken)
                free_tokens[row] -= taken * length
                free_slots[row] -= taken
                left -= taken
                if not left:
                    break
        if left < count:
            open_rows = [row for row in open_rows if free_slots[row] and free_tokens[row] >= smallest]
        piece_rows.append(shape.rows)
        piece_counts.append(left)
    return piece_rows, piece_counts


class ImageSample(NamedTuple):
    patches: torch.Tensor  # (n, p*p*C) uint8
    coords: torch.Tensor  # (n, 2) long (y, x)
    grid: tuple[int, int]  # (h, w) in patches
    label: int


def pack(samples: Sequence[ImageSample], shape: PackedShape, patch_dim: int) -> PackedBatch:
    """Lay the samples out into one PackedBatch; all of them must fit. An empty list gives an
    all-padding batch (a rank's filler step, see PackedBatchSampler)."""
    rows, left_over = first_fit_decreasing([len(s.patches) for s in samples], shape)
    if left_over:
        raise ValueError(f"{len(left_over)} of {len(samples)} images do not fit one batch of {shape}")
    R, L, K = shape.rows, shape.row_len, shape.max_images
    patches = torch.zeros(R, L, patch_dim, dtype=torch.uint8)
    coords = torch.zeros(R, L, 2, dtype=torch.long)
    image_ids = torch.full((R, L), PAD_ID, dtype=torch.long)
    grid = torch.zeros(R, K, 2, dtype=torch.long)
    labels = torch.full((R, K), IGNORE_LABEL, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for slot, pos in enumerate(members):
            sample = samples[pos]
            end = start + len(sample.patches)
            patches[r, start:end] = sample.patches
            coords[r, start:end] = sample.coords
            image_ids[r, start:end] = slot
            grid[r, slot] = torch.tensor(sample.grid)
            labels[r, slot] = sample.label
            start = end
    return PackedBatch(patches, coords, image_ids, grid, labels)


class PackCollate:
    """DataLoader collate_fn: a list of ImageSample -> PackedBatch of a fixed shape.
    None stands for an image that could not be read: it is left out.

    A class rather than a closure so that ddp_spawn can pickle it.
    """

    def __init__(self, shape: PackedShape, patch_dim: int) -> None:
        self.shape = shape
        self.patch_dim = patch_dim

    def __call__(self, samples: Sequence[ImageSample | None]) -> PackedBatch:
        return pack([s for s in samples if s is not None], self.shape, self.patch_dim)
