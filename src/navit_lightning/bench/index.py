"""How fast does a run start on a big folder? The size manifest measured on this machine.

    python -m navit_lightning.bench.index [--images 200000] [--folder DIR] [--ddp] [--formats 1000000]

writes a class folder of `--images` small PNG files (distinct files of a few hundred sizes,
unless --folder holds one already), then prints:
  - the first index (every header read, over the cores) and a second one (files listed and
    stat'ed, none opened: counted with an audit hook), and what a datamodule's setup then
    takes to plan its first epoch from the manifest;
  - with --ddp: train.py with 2 ddp ranks on CPU for one step, without a manifest and with
    one, its wall time and how many processes indexed the folder;
  - with --formats N: save and load times and sizes of N synthetic entries in the manifest's
    format (numpy arrays) against JSON and pickle of the same entries.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from navit_lightning import CONFIG_DIR
from navit_lightning.bench import at_least_one
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.index import (
    IMAGE_SUFFIXES,
    MANIFEST_NAME,
    POOL_FROM,
    Manifest,
    StringTable,
    index_folder,
)
from navit_lightning.data.workers import usable_cores

CLASSES = 10
DISTINCT = 400  # distinct images, copied under many names: writing 200,000 encodes is slow


def write_folder(root: Path, images: int) -> None:
    rng = random.Random(0)
    encoded = []
    for _ in range(DISTINCT):
        buffer = io.BytesIO()
        Image.new("RGB", (rng.randint(16, 400), rng.randint(16, 400)), (rng.randint(0, 255), 90, 90)).save(
            buffer, "PNG"
        )
        encoded.append(buffer.getvalue())
    for name in range(CLASSES):
        (root / f"class_{name}").mkdir(parents=True, exist_ok=True)
    for number in range(images):
        (root / f"class_{number % CLASSES}" / f"{number:07d}.png").write_bytes(encoded[number % DISTINCT])


OPENED = {"count": 0, "on": False}


def _count_opened(event: str, args: tuple) -> None:
    if OPENED["on"] and event == "open" and os.path.splitext(str(args[0]))[1].lower() in IMAGE_SUFFIXES:
        OPENED["count"] += 1


def timed(function: Callable[[], object]) -> tuple[float, int]:
    """Seconds, and image files opened, of one call."""
    OPENED.update(count=0, on=True)
    start = time.perf_counter()
    function()
    seconds = time.perf_counter() - start
    OPENED["on"] = False
    return seconds, OPENED["count"]


def plan_from_manifest(root: Path) -> None:
    datamodule = PackedImageDataModule(str(root), num_workers=0)
    datamodule.setup("fit")
    datamodule.batch_sampler("train").plan_stats()


def start_with_ddp(root: Path, output: Path) -> tuple[float, int]:
    """Wall seconds of a one-step 2-rank ddp train.py, and how many processes indexed."""
    command = [
        sys.executable,
        str(Path(CONFIG_DIR).parent / "train.py"),
        "data=imagefolder",
        f"data.root={root}",
        "strategy=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=1",
        "trainer.limit_val_batches=1",
        "test=false",
        "patch_budgets=null",
        f"paths.log_dir={output}",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, len(
        re.findall(r"indexed \d+ image files", result.stdout + result.stderr)
    )


def compare_formats(count: int) -> list[tuple[str, float, float, float]]:
    """(format, save s, load s, MB) for `count` synthetic manifest entries."""
    rng = np.random.default_rng(0)
    names = [f"class_{i % 1000}/n{i:08d}_{rng.integers(1 << 30):x}.JPEG" for i in range(count)]
    sizes = rng.integers(16, 4000, size=(count, 2)).astype(np.int32)
    stamps = rng.integers(1 << 60, size=(count, 2))
    manifest = Manifest(StringTable.of(names), sizes, stamps, StringTable.of([""] * count))
    rows = [
        [name, *size, *stamp]
        for name, size, stamp in zip(names, sizes.tolist(), stamps.tolist(), strict=True)
    ]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        formats = {
            "numpy arrays (.npz, the manifest)": (
                lambda path: manifest.save(path),
                lambda path: Manifest.load(path).paths.tolist(),
            ),
            "JSON rows": (
                lambda path: path.write_text(json.dumps(rows)),
                lambda path: json.loads(path.read_text()),
            ),
            "pickle of rows": (
                lambda path: path.write_bytes(pickle.dumps(rows)),
                lambda path: pickle.loads(path.read_bytes()),
            ),
        }
        for number, (name, (save, load)) in enumerate(formats.items()):
            path = Path(folder) / f"{number}.bin"
            save_s, _ = timed(lambda save=save, path=path: save(path))
            load_s, _ = timed(lambda load=load, path=path: load(path))
            results.append((name, save_s, load_s, path.stat().st_size / 1e6))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=at_least_one, default=200_000)
    parser.add_argument(
        "--folder",
        type=Path,
        help="images to index, --images of them written there if it is missing, and kept",
    )
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--formats", type=int, default=0, metavar="N")
    args = parser.parse_args()
    sys.addaudithook(_count_opened)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.folder or Path(scratch) / "images"
        if not root.is_dir():
            start = time.perf_counter()
            write_folder(root, args.images)
            print(f"wrote {args.images:,} image files in {time.perf_counter() - start:.0f} s")
        (root / MANIFEST_NAME).unlink(missing_ok=True)
        workers = usable_cores()
        first = timed(lambda: index_folder(root, workers=workers))
        second = timed(lambda: index_folder(root, workers=workers))
        plan = timed(lambda: plan_from_manifest(root))
        print(f"{'step':<58} {'seconds':>8} {'files opened':>13}")
        # a pool's processes open files that this one does not count
        pooled = len(Manifest.load(root / MANIFEST_NAME).paths) >= POOL_FROM
        readers = f"{workers} pool processes read the headers: not counted" if pooled else "this process"
        for name, (seconds, opened) in (
            (f"first index ({readers})", first),
            ("second index (listed and stat'ed)", second),
            ("setup from the manifest and the first epoch's plan", plan),
        ):
            print(f"{name:<58} {seconds:8.2f} {opened:13,}")
        if args.ddp:
            (root / MANIFEST_NAME).unlink()
            for name in ("without a manifest", "with the manifest"):
                seconds, indexed = start_with_ddp(root, Path(scratch) / "logs")
                print(f"train.py, 2 ddp ranks, 1 step, {name}: {seconds:.1f} s, indexed by {indexed} process")
    if args.formats:
        print(f"\n{args.formats:,} entries  {'save s':>7} {'load s':>7} {'MB':>7}")
        for name, save_s, load_s, megabytes in compare_formats(args.formats):
            print(f"{name:<36} {save_s:7.2f} {load_s:7.2f} {megabytes:7.1f}")


if __name__ == "__main__":
    main()
