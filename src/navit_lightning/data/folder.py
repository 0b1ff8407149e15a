"""A folder of class sub-folders holding images of any size, kind and quality."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from navit_lightning.data.packing import ImageSample
from navit_lightning.data.sampler import SampleKey
from navit_lightning.data.transforms import drop_tokens, image_to_sample, upright_size
from navit_lightning.errors import DataError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
# What Pillow raises for a file that is not an image, or not a whole one.
UNREADABLE = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


def find_classes(root: Path) -> list[str]:
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist: set data.root to a folder of class sub-folders")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"image folder {root} has no class sub-folders: put images in {root}/<class>/")
    return classes


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()


def check_class_folders(root: Path, classes: list[str]) -> None:
    """Refuse a class folder without a single image file (its class could never be learnt)."""
    for name in classes:
        if not any(is_image_file(path) for path in (root / name).rglob("*")):
            raise DataError(
                f"class folder {root / name} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}): "
                "add images or remove the folder"
            )


def image_files_under(folder: Path) -> list[Path]:
    """Every image file under `folder`, recursively, sorted."""
    return sorted(path for path in folder.rglob("*") if is_image_file(path))


def list_images(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(path, label) of every image file under root/<class>/, in a stable order."""
    return [(path, label) for label, name in enumerate(classes) for path in image_files_under(root / name)]


FLIP_BITS = (1 << 24) - 1


def mirrored(seed: int, hflip: float) -> bool:
    """Whether an image with this key seed (a uniform 63-bit draw) is flipped, with
    probability hflip: from its low 24 bits, no generator built (that cost ~25 us an image,
    7 % of the loader's time)."""
    return (seed & FLIP_BITS) < hflip * (FLIP_BITS + 1)


class ImageFolder(Dataset):
    """Images as ImageSample patches at the size a SampleKey asks for (native resolution
    capped by its patch budget, some tokens dropped), mirrored left-right with probability
    hflip (a training augmentation; 0 for evaluation); the key's seed picks the dropped
    tokens and the flip.

    Files whose header cannot be read are left out when the folder is scanned; an image
    that fails to decode later (a truncated file) makes __getitem__ return None, which the
    collate drops. Each bad file is warned about once and counted every time
    (`take_unreadable_count`).
    """

    def __init__(self, items: list[tuple[Path, int]], patch_size: int, hflip: float = 0.0) -> None:
        self.patch_size = patch_size
        self.hflip = hflip
        self.items, self.sizes = self._scan(items)
        self.skipped_at_scan = len(items) - len(self.items)
        # Decode failures per image, shared with the DataLoader workers. No lock (a lock would
        # tie the array to one multiprocessing start method): an image is decoded by one
        # worker at a time.
        self.failures = multiprocessing.RawArray("i", len(self.items))
        self._failures_taken = 0  # by take_unreadable_count, in this process

    def _scan(self, items: list[tuple[Path, int]]) -> tuple[list[tuple[Path, int]], list[tuple[int, int]]]:
        """The readable items and their upright (height, width), from the file headers only."""
        readable, sizes = [], []
        for path, label in items:
            try:
                with Image.open(path) as image:
                    height, width = upright_size(image)
            except UNREADABLE as error:
                if rank_zero_only.rank == 0:  # every rank scans the same files
                    log.warning("skipping %s: not a readable image (%s)", path, error)
                continue
            readable.append((path, label))
            sizes.append((height, width))
        return readable, sizes

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: SampleKey) -> ImageSample | None:
        index = key.index
        path, label = self.items[index]
        # Random choices from the key's seed, not the worker's state (see SizePolicy.keys).
        mirror = mirrored(key.seed, self.hflip)
        try:
            with Image.open(path) as image:
                sample = image_to_sample(image, label, self.patch_size, key.max_patches, mirror)
            return drop_tokens(sample, key.keep, key.seed)
        except UNREADABLE as error:
            if not self.failures[index]:
                log.warning("skipping %s: it could not be decoded (%s)", path, error)
            self.failures[index] += 1
            return None

    def take_unreadable_count(self) -> int:
        """Decode failures since the last call, in every worker of this process's loaders."""
        total = int(np.frombuffer(self.failures, dtype=np.int32).sum())
        count, self._failures_taken = total - self._failures_taken, total
        return count
