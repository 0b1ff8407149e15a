"""A folder of class sub-folders holding images of any size."""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageOps
from torch.utils.data import Dataset

from navit_lightning.data.packing import ImageSample
from navit_lightning.data.transforms import fit_grid, image_to_sample

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def find_classes(root: Path) -> list[str]:
    if not root.is_dir():
        raise FileNotFoundError(
            f"image folder {root} does not exist: set data.root to a folder of class sub-folders"
        )
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root} has no class sub-folders: put images in {root}/<class>/")
    return classes


def list_images(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(path, label) of every image file under root/<class>/, in a stable order."""
    items = [
        (path, label)
        for label, name in enumerate(classes)
        for path in sorted((root / name).rglob("*"))
        if path.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not items:
        raise ValueError(f"image folder {root} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return items


class ImageFolder(Dataset):
    """Images as ImageSample patches at native resolution capped by max_patches, mirrored
    left-right with probability hflip (a training augmentation; 0 for evaluation)."""

    def __init__(
        self, items: list[tuple[Path, int]], patch_size: int, max_patches: int, hflip: float = 0.0
    ) -> None:
        self.items = items
        self.patch_size = patch_size
        self.max_patches = max_patches
        self.hflip = hflip

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> ImageSample:
        path, label = self.items[index]
        with Image.open(path) as image:
            if self.hflip and random.random() < self.hflip:
                image = ImageOps.mirror(image)
            return image_to_sample(image, label, self.patch_size, self.max_patches)

    def token_lengths(self) -> list[int]:
        """Patches per image, read from the file headers only (no decoding)."""
        lengths = []
        for path, _ in self.items:
            with Image.open(path) as image:
                grid_h, grid_w = fit_grid(image.height, image.width, self.patch_size, self.max_patches)
            lengths.append(grid_h * grid_w)
        return lengths
