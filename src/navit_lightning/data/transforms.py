"""Image -> patches at (close to) native resolution under a patch budget."""

from __future__ import annotations

import math

import torch
from einops import rearrange
from PIL import Image

from navit_lightning.data.packing import ImageSample


def fit_grid(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """The (rows, cols) patch grid closest to the image's own size, aspect ratio kept,
    with at most max_patches patches and at least one patch per side."""
    scale = min(1.0, math.sqrt(max_patches * patch_size**2 / (height * width)))
    grid_h = max(1, round(height * scale / patch_size))
    grid_w = max(1, round(width * scale / patch_size))
    while grid_h * grid_w > max_patches:  # rounding up may overshoot the budget by a row
        if grid_h >= grid_w:
            grid_h -= 1
        else:
            grid_w -= 1
    return grid_h, grid_w


def image_to_sample(image: Image.Image, label: int, patch_size: int, max_patches: int) -> ImageSample:
    """Resize to the fitted grid and cut into flattened uint8 patches in (p1 p2 c) order."""
    image = image.convert("RGB")
    grid_h, grid_w = fit_grid(image.height, image.width, patch_size, max_patches)
    size = (grid_w * patch_size, grid_h * patch_size)
    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(size[1], size[0], 3)
    patches = rearrange(pixels, "(h p1) (w p2) c -> (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)
    ys, xs = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    coords = torch.stack([ys.flatten(), xs.flatten()], dim=1)
    return ImageSample(patches, coords, (grid_h, grid_w), label)
