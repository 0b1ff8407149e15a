"""Factorized 2D position embeddings: learned row (y) and column (x) tables, added."""

from __future__ import annotations

import torch
from torch import nn

from navit_lightning.errors import ConfigError


class FactorizedPosEmbed(nn.Module):
    """Embeds each token's (y, x) patch coordinate.

    absolute: the table index is the coordinate itself, so max_grid bounds the image side.
    fractional: the index is coordinate / grid side scaled to max_grid, so every image spans
    the whole table whatever its resolution (NaViT's fractional embedding).
    """

    def __init__(self, dim: int, max_grid: int, fractional: bool = False) -> None:
        super().__init__()
        self.max_grid = max_grid
        self.fractional = fractional
        self.y = nn.Parameter(torch.randn(max_grid, dim) * 0.02)
        self.x = nn.Parameter(torch.randn(max_grid, dim) * 0.02)

    def check_coords(self, coords: torch.Tensor) -> None:
        """Refuses coordinates past the absolute tables, naming the fix. A device sync on a
        GPU: the LightningModule calls it on the host batch, before the copy."""
        if coords.numel():
            self.check_side(int(coords.max()) + 1)

    def check_side(self, patches: int, image: str = "an image") -> None:
        """Refuses a side of `image` `patches` long past the absolute tables, naming the fix."""
        if not self.fractional and patches > self.max_grid:
            raise ConfigError(
                f"{image} is {patches} patches long but model.net.max_grid={self.max_grid}: "
                f"scale the images to at most {self.max_grid} patches a side (data.max_patches, "
                "data.min_patches, patch_budgets), or train with a larger model.net.max_grid"
            )

    def forward(self, coords: torch.Tensor, token_grid: torch.Tensor) -> torch.Tensor:
        """coords, token_grid: (..., 2) -> (..., dim)."""
        # Checked where it is free: on the CPU and not under compile (a graph break there).
        if coords.device.type == "cpu" and not torch.compiler.is_compiling():
            self.check_coords(coords)
        if self.fractional:
            coords = coords * self.max_grid // token_grid.clamp(min=1)
        # index_select, not indexing: its backward is an index_add, where indexing's is an
        # index_put that sorts the indices (deterministic mode): 10x slower on a CPU
        flat = coords.flatten(0, -2)
        embedded = self.y.index_select(0, flat[:, 0]) + self.x.index_select(0, flat[:, 1])
        return embedded.unflatten(0, coords.shape[:-1])
