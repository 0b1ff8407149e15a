import pytest
import torch
from einops import rearrange
from PIL import Image

from navit_lightning.data.transforms import fit_grid, image_to_sample


@pytest.mark.parametrize("height", [1, 7, 16, 33, 250, 1000, 4000])
@pytest.mark.parametrize("width", [1, 15, 48, 300, 3000])
def test_fit_grid_keeps_budget_and_aspect(height, width):
    grid_h, grid_w = fit_grid(height, width, patch_size=16, max_patches=64)
    assert 1 <= grid_h * grid_w <= 64
    if height * width <= 64 * 16 * 16 and min(height, width) >= 16:
        # Small enough: native size, rounded to the patch grid.
        assert (grid_h, grid_w) == (round(height / 16), round(width / 16))
    if min(grid_h, grid_w) > 2:
        assert abs(grid_h / grid_w - height / width) / (height / width) < 0.5
    if height * width > 64 * 16 * 16:
        # Larger: scaled down to the budget, of which rounding loses less than a row or column.
        assert grid_h * grid_w > 64 - max(grid_h, grid_w)


def test_patches_round_trip_to_the_resized_image():
    image = Image.effect_noise((48, 32), 50).convert("RGB")  # width 48, height 32: a 2x3 grid
    sample = image_to_sample(image, label=3, patch_size=16, max_patches=64)
    assert sample.grid == (2, 3) and sample.label == 3
    assert sample.patches.dtype == torch.uint8 and sample.patches.shape == (6, 16 * 16 * 3)
    pixels = rearrange(sample.patches, "(h w) (p1 p2 c) -> (h p1) (w p2) c", h=2, p1=16, p2=16)
    expected = torch.tensor(bytearray(image.tobytes()), dtype=torch.uint8).view(32, 48, 3)
    assert torch.equal(pixels, expected)
    assert sample.coords.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_grayscale_and_tiny_images_become_rgb_patch_grids():
    sample = image_to_sample(Image.new("L", (5, 3), 200), label=0, patch_size=16, max_patches=64)
    assert sample.grid == (1, 1) and sample.patches.shape == (1, 16 * 16 * 3)
    assert int(sample.patches.min()) == int(sample.patches.max()) == 200
