"""The batch contract between the data and the network: what a loader yields and a model
eats. It sits below both (data and models import it; it imports neither).

A batch is R rows of L tokens with at most K images per row. Every field keeps the row as
dim 0 and refers only to its own row, so any split along dim 0 is itself a valid batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

PAD_ID = -1
IGNORE_LABEL = -100


class PackedBatch(NamedTuple):
    patches: torch.Tensor  # (R, L, p*p*C) uint8 pixels, normalised on the device
    coords: torch.Tensor  # (R, L, 2) (y, x) of each patch in its image's grid
    # (R, L) image slot of each token in its row, PAD_ID for padding; a row is slot 0's
    # tokens, slot 1's, ..., then its padding (check_layout)
    image_ids: torch.Tensor
    grid: torch.Tensor  # (R, K, 2) (h, w) in patches of each slot; 0 for an empty slot
    labels: torch.Tensor  # (R, K) class of each slot; IGNORE_LABEL for an empty slot

    @property
    def image_slots(self) -> torch.Tensor:
        """(R, K) True where a slot holds an image."""
        return self.grid[..., 0] > 0

    @property
    def num_images(self) -> int:
        return int(self.image_slots.sum())

    @property
    def num_real_tokens(self) -> int:
        return int((self.image_ids != PAD_ID).sum())


def check_layout(image_ids: torch.Tensor) -> None:
    """Refuses a row whose tokens are not its images in slot order and then its padding: the
    segments and varlen backends cut a row by its slots' lengths alone, so a packer of another
    layout had images attend across each other, silently."""
    padding_last = image_ids.masked_fill(image_ids == PAD_ID, torch.iinfo(image_ids.dtype).max)
    out_of_order = (padding_last[:, 1:] < padding_last[:, :-1]).any(1)
    if out_of_order.any():
        row = int(out_of_order.nonzero()[0])
        raise ValueError(
            f"PackedBatch.image_ids, row {row}: a row must hold slot 0's tokens, slot 1's, ..., then "
            "its padding (PAD_ID), as data.packing.pack lays it out"
        )


def image_index(batch: PackedBatch, num_images: int | None = None) -> torch.Tensor:
    """(N,) flat index (row * K + slot) of the batch's N images, in row-major order. Given N
    counted on the host, no device sync (boolean indexing is one: its size is data)."""
    slots = batch.image_slots.flatten()
    if num_images is None:
        return slots.nonzero().squeeze(1)
    return torch.nonzero_static(slots, size=num_images).squeeze(1)


@dataclass(frozen=True)
class PackedShape:
    """The static shape of every batch: rows x row_len tokens, max_images slots per row."""

    rows: int
    row_len: int
    max_images: int

    def __post_init__(self) -> None:
        if min(self.rows, self.row_len, self.max_images) < 1:
            raise ValueError(f"PackedShape needs positive sizes, got {self}")
