"""Tar shards of an image folder, for clusters whose file systems dislike many small files.

    python -m navit_lightning.data.shards <image folder> <shard folder> [--samples-per-shard 5000]
        [--index-dir DIR]

writes <split>-000000.tar, ... in the webdataset layout (each image as <key>.<ext> next to
<key>.cls, its class number, and <key>.json, its path in the folder), a wids index per split
(<split>.wids.json), so that webdataset, wids and other tar readers can read them too, and
the manifest (data/index.py) with each image's size and where its bytes lie in which shard.
`python train.py data=shards data.root=<shard folder>` then trains from them with the same
planned packing as from the folder: each image is read by one seek into its shard.
Files that are not readable images are left out and named; the classes are the folder's.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import tarfile
from pathlib import Path

import numpy as np

from navit_lightning.data.folder import (
    check_class_folders,
    check_every_class_readable,
    find_classes,
    folder_layout,
    left_out,
    split_images,
    warn_unreadable,
)
from navit_lightning.data.index import MANIFEST_NAME, Manifest, StringTable, index_folder
from navit_lightning.data.workers import usable_cores
from navit_lightning.errors import DataError

log = logging.getLogger(__name__)

CLASSES_NAME = "classes.json"
# what write_shards writes into its folder, which it rewrites; it refuses a folder of other
# files (hidden ones aside: a .DS_Store)
SHARD_SET_FILE = re.compile(
    rf"\w+-\d{{6}}\.tar|\w+\.wids\.json|{re.escape(CLASSES_NAME)}|{re.escape(MANIFEST_NAME)}"
)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    folder: Path, out: Path, samples_per_shard: int = 5000, workers: int = 1, index_dir: Path | None = None
) -> Manifest:
    """Shard every readable image under `folder` into `out` (see the module's doc); the
    folder's manifest in `index_dir` where the folder is read-only."""
    if out.resolve().is_relative_to(folder.resolve()):
        # taken for a class folder of no images, then refused: the folder trained no more
        raise DataError(f"{out} is inside the image folder {folder}: write the shards to a folder outside it")
    present = [p.name for p in out.iterdir()] if out.is_dir() else []
    others = sorted(name for name in present if not (SHARD_SET_FILE.fullmatch(name) or name.startswith(".")))
    if others:
        # an image folder's own files lay beside the shards, its manifest replaced by theirs
        raise DataError(
            f"{out} holds other files than a shard set ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}): write the shards to a new or empty folder"
        )
    manifest = index_folder(folder, index_dir, workers=workers)
    layout = folder_layout(folder)
    classes = find_classes(folder / layout["train"])
    check_class_folders(folder / layout["train"], classes)
    out.mkdir(parents=True, exist_ok=True)
    # gone until the new shards are whole: a rewrite cut short read the old spans in the new
    # tars, other images under the old labels, without a word
    for made in (MANIFEST_NAME, CLASSES_NAME):
        (out / made).unlink(missing_ok=True)
    rows, shard_names, spans, loose = [], [], [], {}
    for split, split_folder in layout.items():
        images, unreadable, loose[split_folder] = split_images(manifest, folder, split_folder, classes)
        warn_unreadable(unreadable)
        if split == "train":
            check_every_class_readable(images, classes, folder / split_folder)
        shard_list = []
        for start in range(0, len(images.labels), samples_per_shard):
            name = f"{split}-{start // samples_per_shard:06d}.tar"
            chunk = range(start, min(start + samples_per_shard, len(images.labels)))
            with tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT) as tar:
                for number in chunk:
                    path = images.paths[number]
                    key = f"{len(rows) + number - start:09d}"
                    with images.open(number) as file:
                        _add(tar, f"{key}{Path(path).suffix.lower()}", file.read())
                    _add(tar, f"{key}.cls", str(int(images.labels[number])).encode())
                    _add(tar, f"{key}.json", json.dumps({"path": path}).encode())
            spans += _image_spans(out / name, len(shard_names))
            rows += [images.paths[number] for number in chunk]
            shard_names.append(name)
            shard_list.append({"url": name, "nsamples": len(chunk)})
        wids = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": split}
        (out / f"{split}.wids.json").write_text(json.dumps({**wids, "shardlist": shard_list}, indent=1))
    row_of = {path: row for row, path in enumerate(manifest.paths.tolist())}
    taken = np.array([row_of[path] for path in rows], dtype=np.int64)
    sharded = Manifest(
        StringTable.of(rows),
        manifest.sizes[taken],
        manifest.stamps[taken],
        StringTable.of([""] * len(rows)),
        np.array(spans, dtype=np.int64).reshape(-1, 3),
        StringTable.of(shard_names),
    )
    sharded.save(out / MANIFEST_NAME)
    (out / CLASSES_NAME).write_text(json.dumps(classes))
    written = {*shard_names, *(f"{split}.wids.json" for split in layout), MANIFEST_NAME, CLASSES_NAME}
    for name in present:  # an earlier set's: other tools read its wids indexes, its old labels
        if SHARD_SET_FILE.fullmatch(name) and name not in written:
            (out / name).unlink()
    for line in left_out(manifest, folder, layout, loose):
        log.warning(line)
    log.info("wrote %d images into %d shards in %s", len(rows), len(shard_names), out)
    return sharded


def _image_spans(shard: Path, shard_number: int) -> list[tuple[int, int, int]]:
    """(shard, offset, bytes) of each image in a shard just written, in order."""
    with tarfile.open(shard) as tar:
        return [
            (shard_number, member.offset_data, member.size)
            for member in tar.getmembers()
            if not member.name.endswith((".cls", ".json"))
        ]


def _no_shards(root: Path) -> DataError:
    return DataError(
        f"data.root={root} holds no shards: write them with "
        f"python -m navit_lightning.data.shards <image folder> {root}"
    )


def shard_classes(root: Path) -> list[str]:
    """A shard folder's class names, in label order (its manifest is not read)."""
    if not (root / CLASSES_NAME).is_file():
        raise _no_shards(root)
    return json.loads((root / CLASSES_NAME).read_text())


def load_shards(root: Path) -> Manifest:
    """A shard folder's manifest; refuses a folder without one."""
    manifest = Manifest.load(root / MANIFEST_NAME)
    if manifest is None or manifest.spans is None:
        raise _no_shards(root)
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples-per-shard", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=usable_cores())
    parser.add_argument("--index-dir", type=Path, help="where the folder's manifest goes if it is read-only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    if args.samples_per_shard < 1:
        parser.error(f"--samples-per-shard {args.samples_per_shard}: a shard holds 1 image or more")
    try:
        write_shards(args.folder, args.out, args.samples_per_shard, args.workers, args.index_dir)
    except DataError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
