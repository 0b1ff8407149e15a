"""The size manifest of an image folder: every image file's upright size, read from its
header once, so that no rank of any later run opens a file before the epoch is planned.

    python -m navit_lightning.data.index <folder> [--index-dir DIR] [--workers N]

builds or refreshes it ahead of time; a run does the same in `prepare_data` (one process
per node, the others wait, then read it). A refresh lists the folder and compares each
file's modification time and byte count with the manifest's: only new or changed files are
opened again. The manifest lies in the folder (`.navit_manifest.npz`), or in `index_dir`,
named after the folder, where the folder is read-only; it is numpy arrays (see Manifest),
read without unpickling anything.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import struct
import time
import uuid
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from navit_lightning.data.transforms import opened, upright_size
from navit_lightning.data.workers import map_with_progress, usable_cores
from navit_lightning.errors import DataError

log = logging.getLogger(__name__)

# Pillow reads them all (.jfif: what browsers on Windows save a JPEG as)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".jfif", ".jpe", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".avif"}
IMAGE_SUFFIXES |= {".ppm", ".pgm", ".pbm"}
# What Pillow raises for a file that is not an image, or not a whole one; its plugins raise
# more on a malformed file (byte-flip fuzzing found AVIF's RuntimeError and TIFF's TypeError).
UNREADABLE = (
    UnidentifiedImageError,
    OSError,
    SyntaxError,
    ValueError,
    Image.DecompressionBombError,
    RuntimeError,
    TypeError,
    EOFError,
    struct.error,
)
MANIFEST_NAME = ".navit_manifest.npz"
# How a file name that is not UTF-8 (an old zip's caf\xe9.jpg) is encoded: back to the bytes
# it has on disk, as os.fsencode does
SURROGATES = "surrogateescape"
MANIFEST_VERSION = 1
# A pool's processes take ~5 s to start (they import torch) where one process reads a local
# file's header in ~20 us: below this many files it costs more than it saves (on a network
# file system, where a file takes milliseconds, far less would pay).
POOL_FROM = 100_000


class StringTable:
    """Many strings as one UTF-8 buffer and their end offsets: a million paths pickle (to
    every loader worker) and save as two arrays, not a million objects."""

    def __init__(self, buffer: np.ndarray, ends: np.ndarray) -> None:
        self.buffer = buffer  # (bytes,) uint8
        self.ends = ends  # (N,) int64, string i is buffer[ends[i - 1]:ends[i]]

    @classmethod
    def of(cls, strings: list[str]) -> StringTable:
        encoded = [string.encode(errors=SURROGATES) for string in strings]
        ends = np.cumsum([len(item) for item in encoded], dtype=np.int64)
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), ends)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> str:
        start = self.ends[index - 1] if index else 0
        return self.buffer[start : self.ends[index]].tobytes().decode(errors=SURROGATES)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StringTable)
            and np.array_equal(self.ends, other.ends)
            and np.array_equal(self.buffer, other.buffer)
        )

    def tolist(self) -> list[str]:
        return [self[index] for index in range(len(self))]

    def take(self, indices: np.ndarray) -> StringTable:
        return StringTable.of([self[index] for index in indices.tolist()])


@dataclass
class Manifest:
    """Every image file under a folder, sorted by path: its upright (height, width), or
    (-1, -1) and the reason where its header cannot be read, and the (mtime_ns, bytes) it
    had when read."""

    paths: StringTable  # relative to the folder, with "/" between parts
    sizes: np.ndarray  # (N, 2) int32
    stamps: np.ndarray  # (N, 2) int64
    reasons: StringTable  # "" for a readable file
    # A shard folder's (data/shards.py): where each image's bytes are, (shard, offset, bytes)
    spans: np.ndarray | None = None  # (N, 3) int64
    shard_names: StringTable | None = None

    def same_as(self, other: Manifest) -> bool:
        return (
            self.paths == other.paths
            and np.array_equal(self.sizes, other.sizes)
            and np.array_equal(self.stamps, other.stamps)
            and self.reasons == other.reasons
        )

    @property
    def readable(self) -> np.ndarray:  # (N,) bool
        return self.sizes[:, 0] >= 0

    def save(self, path: Path) -> None:
        """Written whole, then renamed: a reader sees the old manifest or the new one. Its
        name drawn at random: two writers of one process id (containers, nodes on a shared
        file system) renamed one file, and the second failed."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(partial, "xb") as file:
                np.savez(
                    file,
                    version=np.array(MANIFEST_VERSION),
                    path_buffer=self.paths.buffer,
                    path_ends=self.paths.ends,
                    sizes=self.sizes,
                    stamps=self.stamps,
                    reason_buffer=self.reasons.buffer,
                    reason_ends=self.reasons.ends,
                    **self._shard_arrays(),
                )
            os.replace(partial, path)
        finally:  # a full disk left one in the user's image folder at every try
            partial.unlink(missing_ok=True)

    def _shard_arrays(self) -> dict[str, np.ndarray]:
        if self.spans is None or self.shard_names is None:
            return {}
        return {
            "spans": self.spans,
            "shard_buffer": self.shard_names.buffer,
            "shard_ends": self.shard_names.ends,
        }

    @classmethod
    def load(cls, path: Path) -> Manifest | None:
        """The manifest at `path`, or None if there is none of this version, or none whole (a
        half-copied file is indexed again, not a crash)."""
        try:
            with np.load(path) as arrays:
                if int(arrays["version"]) != MANIFEST_VERSION:
                    return None
                return cls(
                    StringTable(arrays["path_buffer"], arrays["path_ends"]),
                    arrays["sizes"],
                    arrays["stamps"],
                    StringTable(arrays["reason_buffer"], arrays["reason_ends"]),
                    *(
                        (arrays["spans"], StringTable(arrays["shard_buffer"], arrays["shard_ends"]))
                        if "spans" in arrays
                        else ()
                    ),
                )
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # missing, not ours, cut
            return None


def is_hidden(name: str) -> bool:
    """A file or folder no class holds: hidden ones, and a Synology NAS's @eaDir (its
    thumbnails of every image, beside them)."""
    return name.startswith(".") or name == "@eaDir"


def image_entries(root: Path, others: Counter[str] | None = None) -> Iterator[tuple[str, os.DirEntry]]:
    """Every image file under root, as (its path relative to root, its directory entry), in
    no set order: what the manifest, the check of class folders and predict.py take for the
    images. Hidden entries are skipped (a macOS zip's __MACOSX/ holds only ._ files); linked
    folders are followed, but not into a folder they are in (that would loop). A folder reached
    by two paths gives its images under both: taken once, the first path listed won, and a
    link beside the splits (left out) could take a class's images away. Other files are
    counted in `others` by their suffix (a phone's .heic photos were left out without a word),
    and links that lead to nothing as such."""
    folders = [(root, "", frozenset({_folder_id(root)}))]  # and the folders it is in
    while folders:
        folder, prefix, above = folders.pop()
        try:
            listing = os.scandir(folder)
        except OSError as error:  # a sub-folder its owner keeps to themselves, a lost+found
            log.warning("skipping %s: its files cannot be listed (%s)", folder, error)
            continue
        with listing as entries:
            for entry in entries:
                if is_hidden(entry.name):
                    continue
                if entry.is_dir():
                    if (folder_id := _folder_id(entry)) not in above:
                        folders.append((Path(entry.path), f"{prefix}{entry.name}/", above | {folder_id}))
                elif entry.is_file():
                    suffix = os.path.splitext(entry.name)[1].lower()
                    if suffix in IMAGE_SUFFIXES:
                        yield prefix + entry.name, entry
                    elif others is not None:
                        others[suffix] += 1
                elif entry.is_symlink() and others is not None:  # its target gone, or a loop
                    others["links to nothing"] += 1


def other_files(others: Counter[str]) -> str:
    """What image_entries counted in `others` (some), for a log line: "3 file(s) of other
    types left out (.heic 2, no suffix 1)"."""
    kinds = ", ".join(f"{suffix or 'no suffix'} {count}" for suffix, count in others.most_common(5))
    more = ", ..." if len(others) > 5 else ""
    return f"{others.total()} file(s) of other types left out ({kinds}{more})"


def _folder_id(folder: Path | os.DirEntry) -> tuple[int, int]:
    stat = folder.stat() if isinstance(folder, os.DirEntry) else os.stat(folder)  # through links
    return stat.st_dev, stat.st_ino


def list_image_files(root: Path, others: Counter[str] | None = None) -> tuple[list[str], np.ndarray]:
    """Every image file under root (image_entries), sorted: relative paths and (N, 2)
    (mtime_ns, bytes), from one directory listing and one stat per file (none is opened)."""
    found: list[tuple[str, int, int]] = []
    for path, entry in image_entries(root, others):
        stat = entry.stat()
        found.append((path, stat.st_mtime_ns, stat.st_size))
    found.sort()
    stamps = np.array([(mtime, size) for _, mtime, size in found], dtype=np.int64).reshape(-1, 2)
    return [path for path, _, _ in found], stamps


def read_size(path: str) -> tuple[int, int] | str:
    """The upright (height, width) from the file's header, or why it cannot be read."""
    try:
        with opened(path) as image:
            return upright_size(image)
    except UNREADABLE as error:
        return str(error) or type(error).__name__


def read_sizes(paths: list[str], workers: int, description: str) -> list[tuple[int, int] | str]:
    """read_size of each path, over `workers` processes when there are many."""
    if workers <= 1 or len(paths) < POOL_FROM:
        return [read_size(path) for path in paths]
    return list(map_with_progress(read_size, paths, description, workers, chunksize=512))


def manifest_path(root: Path, index_dir: str | Path | None = None) -> Path:
    """In the folder, or in `index_dir` under a name unique to the folder."""
    if index_dir is None:
        return root / MANIFEST_NAME
    index, folder = Path(index_dir).resolve(), root.resolve()
    # inside the folder it would be a class folder; a hidden one is no class
    if index == folder or (
        index.is_relative_to(folder) and not is_hidden(index.relative_to(folder).parts[0])
    ):
        raise DataError(
            f"index folder {index_dir} is inside the image folder {root}: put data.index_dir "
            "(or --index-dir) outside it"
        )
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return Path(index_dir) / f"{folder.name}-{digest}.npz"


def _unchanged(
    names: list[str], paths: StringTable, stamps: np.ndarray, old: Manifest
) -> tuple[np.ndarray, np.ndarray]:
    """(rows in `names`, rows in `old`) of the files `old` holds with the same stamps."""
    if paths == old.paths:  # the usual case, compared as two arrays, not N strings
        rows = was = np.arange(len(names))
    else:
        old_rows = {name: row for row, name in enumerate(old.paths.tolist())}
        rows = np.array([row for row, name in enumerate(names) if name in old_rows], dtype=np.int64)
        was = np.array([old_rows[names[row]] for row in rows.tolist()], dtype=np.int64)
    same = (old.stamps[was] == stamps[rows]).all(axis=1)
    return rows[same], was[same]


def index_folder(
    root: Path, index_dir: str | Path | None = None, workers: int = 1, name_others: bool = True
) -> Manifest:
    """The manifest of every image file under root, brought up to date and saved: files
    whose (mtime_ns, bytes) match the saved manifest are not opened. name_others: the line
    counts the other files by suffix (not in the built-in set, whose marker is its own)."""
    started = time.perf_counter()
    path = manifest_path(root, index_dir)
    others: Counter[str] = Counter()
    names, stamps = list_image_files(root, others)
    paths = StringTable.of(names)
    old = Manifest.load(path)
    sizes = np.full((len(names), 2), -1, dtype=np.int32)
    reasons = [""] * len(names)
    known = np.zeros(len(names), dtype=bool)
    if old is not None:
        rows, was = _unchanged(names, paths, stamps, old)
        # An unreadable file is read again: a chmod, a mended mount or a newer Pillow may let it in.
        readable = old.sizes[was, 0] >= 0
        known[rows[readable]], sizes[rows[readable]] = True, old.sizes[was[readable]]
    to_read = np.flatnonzero(~known)
    to_open = [str(root / names[row]) for row in to_read.tolist()]
    results = read_sizes(to_open, workers, f"Reading image sizes in {root}")
    for row, result in zip(to_read.tolist(), results, strict=True):
        if isinstance(result, str):
            reasons[row] = result
        else:
            sizes[row] = result
    manifest = Manifest(paths, sizes, stamps, StringTable.of(reasons))
    removed = 0 if old is None or paths == old.paths else len(set(old.paths.tolist()) - set(names))
    if old is None or not manifest.same_as(old):
        if index_dir is None and not os.access(root, os.W_OK):
            raise DataError(
                f"image folder {root} is read-only: set data.index_dir (train.py) or --index-dir "
                "(the index and shards commands) to a writable folder"
            )
        try:
            manifest.save(path)
        except OSError as error:  # an index_dir that is read-only or a file, a full disk
            raise DataError(
                f"the manifest {path} cannot be written ({error.strerror}): give data.index_dir "
                "(train.py) or --index-dir (the index and shards commands) a writable folder with space"
            ) from None
    log.info(
        "indexed %d image files under %s in %.1f s: %d read (new, changed or unreadable), %d gone, "
        "%d unreadable; manifest %s%s",
        len(names),
        root,
        time.perf_counter() - started,
        len(to_read),
        removed,
        int((~manifest.readable).sum()),
        path,
        f"; {other_files(others)}" if others and name_others else "",
    )
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--index-dir", default=None, help="where the manifest goes if not in the folder")
    parser.add_argument("--workers", type=int, default=usable_cores())
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    try:
        index_folder(args.folder, args.index_dir, args.workers)
    except DataError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
