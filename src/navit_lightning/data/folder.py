"""A folder of class sub-folders holding images of any size, kind and quality."""

from __future__ import annotations

import hashlib
import io
import logging
import multiprocessing
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from torch.utils.data import Dataset

from navit_lightning.data.index import (
    IMAGE_SUFFIXES,
    SURROGATES,
    UNREADABLE,
    Manifest,
    StringTable,
    image_entries,
    is_hidden,
    other_files,
    read_sizes,
)
from navit_lightning.data.packing import ImageSample
from navit_lightning.data.sampler import SampleKey
from navit_lightning.data.transforms import drop_tokens, image_to_sample, opened
from navit_lightning.errors import DataError

log = logging.getLogger(__name__)


def folder_names(root: Path) -> list[str]:
    """root's sub-folders, sorted, hidden ones left out (a macOS zip's __MACOSX/ is not)."""
    return sorted(path.name for path in root.iterdir() if path.is_dir() and not is_hidden(path.name))


def find_classes(root: Path) -> list[str]:
    classes = folder_names(root)
    if not classes:
        shards = (
            " (its .tar files: shards of one? read them with data=shards)" if any(root.glob("*.tar")) else ""
        )
        raise DataError(
            f"image folder {root} has no class sub-folders: put images in {root}/<class>/{shards}"
        )
    return classes


def check_class_folders(root: Path, classes: list[str]) -> None:
    """Refuse a class folder without a single image file (its class could never be learnt),
    and a single class (nothing to tell apart)."""
    for name in classes:
        others: Counter[str] = Counter()
        if next(image_entries(root / name, others), None) is None:  # a phone's .heic photos alone
            if not os.access(root / name, os.R_OK | os.X_OK):
                raise DataError(
                    f"class folder {root / name} cannot be listed (permission denied): give this "
                    "user read access to it, or remove it"
                )
            held = f", {other_files(others)}" if others else ""
            raise DataError(
                f"class folder {root / name} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}){held}: "
                "add images or remove the folder"
            )
    if len(classes) < 2:
        raise DataError(
            f"image folder {root} has one class folder ({classes[0]}): a classifier needs two or "
            f"more, {root}/<class>/ each"
        )


def check_every_class_readable(images: Images, classes: list[str], folder: Path) -> None:
    """Refuse training images where a class has no readable one (all its files unreadable):
    it could never be learnt."""
    learnt = set(np.unique(images.labels).tolist())
    empty = [name for label, name in enumerate(classes) if label not in learnt]
    if empty:
        raise DataError(
            f"class folder {folder / empty[0]} holds no readable image (named above): add readable "
            "images or remove the folder"
        )


def image_files_under(folder: Path, others: Counter[str] | None = None) -> list[Path]:
    """Every image file under `folder` (index.image_entries, which counts the other files in
    `others`), sorted."""
    return sorted(folder / path for path, _ in image_entries(folder, others))


@dataclass
class Images:
    """Readable images: paths (relative to root, or absolute with root Path()), labels and
    upright sizes, as arrays: what a loader worker is sent, for a million images too."""

    root: Path
    paths: StringTable
    labels: np.ndarray  # (N,) int64
    sizes: np.ndarray  # (N, 2) int32, (height, width)
    # In a shard folder: (shard, offset, bytes) of each image in root/<shard name>
    spans: np.ndarray | None = None  # (N, 3) int64
    shard_names: StringTable | None = None

    def take(self, rows: np.ndarray) -> Images:
        spans = None if self.spans is None else self.spans[rows]
        return Images(
            self.root, self.paths.take(rows), self.labels[rows], self.sizes[rows], spans, self.shard_names
        )

    def digest(self) -> bytes:
        """Of the images' paths under root, labels and sizes: what a rank plans its epochs from."""
        content = hashlib.sha1()
        for array in (self.paths.buffer, self.paths.ends, self.labels, self.sizes):
            content.update(np.ascontiguousarray(array).data)
        return content.digest()

    def name(self, index: int) -> str:
        """The image's file, or its shard and its path before it was sharded."""
        if self.spans is None or self.shard_names is None:
            return str(self.root / self.paths[index])
        return f"{self.root / self.shard_names[int(self.spans[index, 0])]}:{self.paths[index]}"

    def open(self, index: int) -> BinaryIO:
        """The image's bytes, from its file or its span of a shard (one read)."""
        if self.spans is None or self.shard_names is None:
            return open(self.root / self.paths[index], "rb")
        shard, offset, length = self.spans[index].tolist()
        with open(self.root / self.shard_names[shard], "rb") as file:
            file.seek(offset)
            return io.BytesIO(file.read(length))


def hold_out(images: Images, fraction: float, seed: int, by_path: bool) -> tuple[Images, Images]:
    """(the rest, a `fraction` of the images): train and val where no val/ is given. by_path:
    each image by a draw from its path and `seed` alone, so that images added to the folder
    later leave every other image in its split (about `fraction` of them, one at least);
    else the first `fraction` of a seeded shuffle of them all (runs from before by_path)."""
    if by_path:
        draws = np.array([path_draw(path, seed) for path in images.paths.tolist()])
        held = draws < fraction
        held[np.argmin(draws)] = True
        return images.take(np.flatnonzero(~held)), images.take(np.flatnonzero(held))
    order = list(range(len(images.labels)))
    random.Random(seed).shuffle(order)
    held_out = max(1, round(len(order) * fraction))
    return images.take(np.array(order[held_out:], dtype=np.int64)), images.take(
        np.array(order[:held_out], dtype=np.int64)
    )


def path_draw(path: str, seed: int) -> float:
    """A uniform draw in [0, 1) from a file's path and a seed alone."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(errors=SURROGATES), digest_size=8).digest()
    return int.from_bytes(digest) / 2**64


Unreadable = list[tuple[Path, str]]  # (path, why)


# The folders that hold a split of a root's images, by their names in any case.
SPLIT_NAMES = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test",)}


def split_layout(
    root: Path,
    folders: Iterable[str],
    subfolders: Callable[[str], set[str]],
    has_images: Callable[[str], bool],
    need_train: bool = True,
) -> dict[str, str]:
    """Which of root's top-level `folders` holds each split: {"train": "Train", "val":
    "valid"} where a train folder holds folders (`subfolders(name)`: their names), else
    {"train": ""}: root's own class folders, val held out. A folder named after a split that
    holds images alone is a class (CIFAR-100 has a class "train"), and so is a val/ or test/
    of sub-folders beside other classes (a class's images may lie in folders: valid/2023/).
    A val/ or test/ without train/ is refused (it would be a class), but where `need_train`
    is off (an evaluation) it is a split."""
    found: dict[str, list[str]] = {split: [] for split in SPLIT_NAMES}
    nested: dict[str, set[str]] = {}
    for name in folders:
        split = next((split for split, names in SPLIT_NAMES.items() if name.lower() in names), None)
        if split is not None:
            nested[name] = subfolders(name)
            if nested[name]:
                found[split].append(name)
    for split, names in found.items():
        if len(names) > 1:
            raise DataError(
                f"image folder {root} has {len(names)} {split} folders ({', '.join(sorted(names))}): keep one"
            )
    layout = {split: names[0] for split, names in found.items() if names}
    if not layout:
        check_no_splits_as_classes(root, list(folders), subfolders, has_images)
        return {"train": ""}
    if "train" in layout:
        return layout
    classes = [name for name in folders if name not in layout.values() and has_images(name)]
    beside = any(nested[name] & set(classes) for name in layout.values())  # test/cat/ beside cat/
    if classes and not beside:
        check_no_splits_as_classes(root, list(folders), subfolders, has_images)
        return {"train": ""}
    if need_train or beside:
        stray = next(iter(layout.values()))
        raise DataError(
            f"image folder {root} has {stray}/ but no train/ folder: put the training images in "
            f"{root}/train/<class>/"
        )
    return layout


def check_no_splits_as_classes(
    root: Path, classes: list[str], subfolders: Callable[[str], set[str]], has_images: Callable[[str], bool]
) -> None:
    """Refuse splits where classes were looked for: train/ and test/ that hold images (a
    layout whose labels are in the file names) were trained as two classes, and a class's own
    train/ and val/ were pooled, the user's held-out images trained on. (`has_images` of a
    path under root: a class's empty test/ is no split.)"""
    splits = {name for names in SPLIT_NAMES.values() for name in names}
    if len(classes) > 1 and all(name.lower() in splits for name in classes):
        raise DataError(
            f"image folder {root}: {', '.join(f'{name}/' for name in classes)} hold images, not class "
            f"folders: put the training images in {root}/train/<class>/, a folder per class"
        )
    # each class's sub-folders that hold images
    inner = [
        {folder.lower() for folder in subfolders(name) if has_images(f"{name}/{folder}")} for name in classes
    ]
    if inner and all(names and names <= splits for names in inner):
        found = ", ".join(f"{name}/" for name in sorted(set().union(*inner)))
        raise DataError(
            f"image folder {root}: its class folders hold {found}: put the splits above the "
            f"classes, {root}/train/<class>/ and {root}/val/<class>/"
        )


# data.root alone is refused by eval.py, which takes the data group from the checkpoint
GIVE_ROOT = "give data=imagefolder data.root=<the folder of class sub-folders>"


def folder_layout(root: Path, need_train: bool = True) -> dict[str, str]:
    """split_layout of a folder on disk."""
    if root.is_file():  # an archive of the images, most often
        raise DataError(f"image folder {root} is a file: unpack it, and {GIVE_ROOT}")
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist: {GIVE_ROOT}")

    def subfolders(name: str) -> set[str]:
        return set(folder_names(root / name))

    def has_images(name: str) -> bool:
        return next(image_entries(root / name), None) is not None

    return split_layout(root, folder_names(root), subfolders, has_images, need_train)


def paths_layout(root: Path, paths: list[str], need_train: bool = True) -> dict[str, str]:
    """split_layout of the folder that held `paths` (a shard folder's manifest paths)."""
    nested: dict[str, set[str]] = {}  # top-level folder -> the folders in it
    for path in paths:
        top, _, rest = path.partition("/")
        if rest:
            inner, _, file = rest.partition("/")
            nested.setdefault(top, set()).update([inner] if file else [])
    return split_layout(root, nested, nested.__getitem__, nested.__contains__, need_train)


def split_images(
    manifest: Manifest, root: Path, folder: str, classes: list[str]
) -> tuple[Images, Unreadable, list[str]]:
    """The readable images under root/<folder>/<class>/ (root/<class>/ for folder "") with
    their classes' labels, the unreadable ones, and the paths of the images beside the class
    folders (in no class), from root's manifest (a shard folder's: the paths its images had)."""
    prefix = f"{folder}/" if folder else ""
    label_of = {name: label for label, name in enumerate(classes)}
    labels = np.full(len(manifest.paths), -1, dtype=np.int64)
    unknown: set[str] = set()
    loose: list[str] = []
    for row, path in enumerate(manifest.paths.tolist()):
        if not path.startswith(prefix):  # another split's
            continue
        end = path.find("/", len(prefix))
        if end < 0:
            loose.append(path)
            continue
        label = label_of.get(path[len(prefix) : end])
        if label is None:
            unknown.add(path[len(prefix) : end])
        else:
            labels[row] = label
    if unknown:  # val/ or test/: their images would be left out without a word
        names = sorted(unknown)
        raise DataError(
            f"{root / folder} has class folders that {root / 'train'} has not ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): a network trained on train/ could give their images "
            "no label; give every split the class folders of train/"
        )
    rows = np.flatnonzero(labels >= 0)
    readable = manifest.readable[rows]
    unreadable = [(root / manifest.paths[row], manifest.reasons[row]) for row in rows[~readable].tolist()]
    everything = Images(root, manifest.paths, labels, manifest.sizes, manifest.spans, manifest.shard_names)
    return everything.take(rows[readable]), unreadable, loose


def left_out(
    manifest: Manifest, root: Path, layout: dict[str, str], loose: dict[str, list[str]]
) -> list[str]:
    """A line for each part of root that no split reads: the images beside a split's class
    folders (`loose`, by split folder, from split_images), and what lies beside the split
    folders."""
    lines = [
        f"{root / folder}: left out {len(paths)} image(s) beside its class folders "
        f"({paths[0]}{', ...' if len(paths) > 1 else ''}): "
        "an image's class is the folder it is in"
        for folder, paths in loose.items()
        if paths
    ]
    if "" not in layout.values():  # split folders: any others beside them are left out
        splits_in = [f"{name}/" for name in layout.values()]
        tops = {path.split("/", 1)[0] + "/" if "/" in path else path for path in manifest.paths.tolist()}
        unused = sorted(tops - {*splits_in})  # folders, and images beside the split folders
        if unused:
            lines.append(f"{root}: left out {', '.join(unused)} (the splits are {', '.join(splits_in)})")
    return lines


def unevaluated_classes(splits: dict[str, Images], classes: list[str]) -> list[str]:
    """A line for each evaluation split that holds no image of some classes trained on: its
    accuracy, and the best checkpoint that val/acc picks, say nothing of them."""
    lines = []
    for name in ("val", "test"):
        if "train" not in splits or name not in splits or splits[name] is splits["train"]:
            continue
        unseen = [classes[label] for label in np.setdiff1d(splits["train"].labels, splits[name].labels)]
        if unseen:
            shown = ", ".join(unseen[:5]) + (f" and {len(unseen) - 5} more" if len(unseen) > 5 else "")
            lines.append(f"the {name} split holds no image of {shown}: {name}/acc says nothing of them")
    return lines


CLASSES_NAMED = 10  # in the line of the classes' counts; the others are counted


def classes_line(root: Path, classes: list[str], splits: dict[str, Images]) -> str:
    """The classes and their images in each split, in one line: a data.root one level too
    high (the parent of two copies of the data) trained on the copies as classes, silently."""
    counts = {split: np.bincount(images.labels, minlength=len(classes)) for split, images in splits.items()}
    named = ", ".join(
        f"{name} {'/'.join(str(count[label]) for count in counts.values())}"
        for label, name in enumerate(classes[:CLASSES_NAMED])
    )
    others = f" and {len(classes) - CLASSES_NAMED} more" if len(classes) > CLASSES_NAMED else ""
    totals = ", ".join(f"{int(count.sum())} {split}" for split, count in counts.items())
    return f"{root}: {len(classes)} classes, {totals} images; {'/'.join(counts)} by class: {named}{others}"


def images_of_files(items: list[tuple[Path, int]], workers: int = 1) -> tuple[Images, Unreadable]:
    """Like split_images for (path, label) items without a manifest: their headers read here."""
    results = read_sizes([str(path) for path, _ in items], workers, "Reading image sizes")
    kept = [row for row, result in enumerate(results) if not isinstance(result, str)]
    unreadable = [(path, why) for (path, _), why in zip(items, results, strict=True) if isinstance(why, str)]
    images = Images(
        Path(),
        StringTable.of([str(items[row][0]) for row in kept]),
        np.array([items[row][1] for row in kept], dtype=np.int64),
        np.array([results[row] for row in kept], dtype=np.int32).reshape(-1, 2),
    )
    return images, unreadable


def within_pixels(images: Images, max_pixels: int | None) -> tuple[Images, Unreadable]:
    """The images of at most `max_pixels` (height x width; None: any), and why each other one
    is left out: a loader worker decodes an image whole (~3 bytes a pixel), a JPEG at 1/8 of
    its sides at the least."""
    if max_pixels is None:
        return images, []
    pixels = images.sizes.astype(np.int64).prod(axis=1)
    unreadable = [
        (
            Path(images.name(row)),
            f"{images.sizes[row, 1]} x {images.sizes[row, 0]} = {pixels[row]:,} pixels, over "
            f"data.max_image_pixels={max_pixels:,}: raise it, or set it to null, to read it "
            "(eval.py and predict.py: +data.max_image_pixels=<pixels>)",
        )
        for row in np.flatnonzero(pixels > max_pixels).tolist()
    ]
    return (images.take(np.flatnonzero(pixels <= max_pixels)) if unreadable else images), unreadable


def warn_unreadable(unreadable: Unreadable) -> None:
    for path, why in unreadable:
        log.warning("skipping %s: not a readable image (%s)", path, why)


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

    Files whose header cannot be read were left out before (split_images); an image that
    fails to decode later (a truncated file) makes __getitem__ return None, which the
    collate drops. Each such file is counted every time (`take_unreadable_count`) and named
    once (`name_new_failures`, which its loader calls).
    """

    def __init__(self, images: Images, patch_size: int, hflip: float = 0.0) -> None:
        self.images = images
        self.patch_size = patch_size
        self.hflip = hflip
        # Decode failures per image, shared with the DataLoader workers. No lock (a lock would
        # tie the array to one multiprocessing start method): an image is decoded by one
        # worker at a time.
        self.failures = multiprocessing.RawArray("i", len(self))
        self._failures_taken = 0  # by take_unreadable_count, in this process
        self._named = np.zeros(len(self), dtype=bool)  # the failed files it has named

    @property
    def sizes(self) -> np.ndarray:
        return self.images.sizes

    def __len__(self) -> int:
        return len(self.images.labels)

    def __getitem__(self, key: SampleKey) -> ImageSample | None:
        index = key.index
        # Random choices from the key's seed, not the worker's state (see SizePolicy.keys).
        mirror = mirrored(key.seed, self.hflip)
        try:
            with self.images.open(index) as file, opened(file) as image:
                sample = image_to_sample(
                    image, int(self.images.labels[index]), self.patch_size, key.max_patches, mirror
                )
            return drop_tokens(sample, key.keep, key.seed)
        except UNREADABLE:
            self.failures[index] += 1
            return None

    def take_unreadable_count(self) -> int:
        """Decode failures since the last call, in every worker of this process's loaders."""
        total = int(np.frombuffer(self.failures, dtype=np.int32).sum())
        count, self._failures_taken = total - self._failures_taken, total
        return count

    def failed(self) -> np.ndarray:
        """(images,) bool: each image has failed to decode in this process's loaders."""
        return np.frombuffer(self.failures, dtype=np.int32) > 0

    def name_new_failures(self) -> None:
        """Name each file that has failed to decode since the last call, once: from the process
        that logs to the run's console and train.log (a loader worker's log reached neither)."""
        failed = self.failed()
        for index in np.flatnonzero(failed & ~self._named):
            log.warning("skipping %s: it could not be decoded%s", self.images.name(index), self._why(index))
        self._named |= failed

    def _why(self, index: int) -> str:
        """What decoding the file in full says, as ` (<error>)`; the loader's decode may have
        failed at a reduced size only."""
        try:
            with self.images.open(index) as file, opened(file) as image:
                image.load()
        except UNREADABLE as error:
            return f" ({error})"
        return ""
