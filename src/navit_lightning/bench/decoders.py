"""Does one loader worker keep up? Images/s of turning photo-size JPEG files into the patches
the loader makes (transforms.image_to_sample), per JPEG decoder, in one process.

    python -m navit_lightning.bench.decoders [--folder DIR] [--count N] [--budgets 36 256]
        [--decoders pillow+draft simplejpeg pyturbojpeg] [--max-side PX] [--rounds R] [--json FILE]

Without --folder it writes `--count` photo-like JPEGs into a temporary folder: 80 % at
common camera and web sizes (320x240 .. 2048x1536, either orientation), 20 % with random
sides 100..2500 px; smooth colour fields, shapes and sensor-like noise, quality 90, one in
four with an EXIF orientation tag (2..8); --max-side scales them down (500: ImageNet-like
files, or a data set stored at the largest size training uses). Each decoder makes every
file's sample at each patch budget (16 px patches; 36 is data.max_patches' default, 256 a
large budget: 256 x 256 px); the decoders take turns, one pass over the folder each per round,
so the machine's drifts hit them alike, and each reports its median images/s over the
rounds, its ratio to pillow+draft (Pillow decoding at reduced JPEG scale via draft: the
loader's path) and how far its patches are from pillow+draft's (mirrored, EXIF applied):
grids must be equal, pixel values differ at most by the libraries' IDCT rounding.

Decoders that do not install or load here are listed with the reason. pillow-simd replaces
Pillow itself, so it cannot run beside it: run this command in a venv that has it, with
`--decoders pillow+draft`, and compare with a run of the project's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from navit_lightning.bench import at_least_one
from navit_lightning.data.folder import image_files_under
from navit_lightning.data.packing import ImageSample
from navit_lightning.data.transforms import ORIENTATION_TAG, JpegDecoder, image_to_sample, opened

PATCH_SIZE = 16
CAMERA_SIZES = [(320, 240), (640, 480), (800, 600), (1024, 768), (1280, 720), (1280, 960)]
CAMERA_SIZES += [(1600, 1200), (1920, 1080), (2048, 1536)]
PILLOW = "pillow+draft"


def photo_like(width: int, height: int, rng: random.Random) -> Image.Image:
    """Smooth colour gradients, a few flat shapes and per-pixel noise: what makes a JPEG's
    entropy decoding cost what a photo's does (a flat or pure-noise image would not)."""
    field = np.array([[rng.choices(range(256), k=3) for _ in range(4)] for _ in range(3)], np.uint8)
    image = Image.fromarray(field).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 6)):
        x, y = rng.randrange(width), rng.randrange(height)
        box = (x, y, x + rng.randint(1, width // 2 + 1), y + rng.randint(1, height // 2 + 1))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape(box, fill=tuple(rng.choices(range(256), k=3)))
    noise = np.asarray(Image.effect_noise((width, height), rng.uniform(4, 12)), np.int16) - 128
    pixels = np.asarray(image, np.int16) + noise[..., None]
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def photo_size(rng: random.Random, max_side: int | None) -> tuple[int, int]:
    if rng.random() < 0.8:
        width, height = rng.choice(CAMERA_SIZES)
        width, height = (width, height) if rng.random() < 0.5 else (height, width)
    else:
        width, height = rng.randint(100, 2500), rng.randint(100, 2500)
    scale = min(1.0, max_side / max(width, height)) if max_side else 1.0
    return max(1, round(width * scale)), max(1, round(height * scale))


def write_photo_folder(folder: Path, count: int, max_side: int | None = None, seed: int = 0) -> list[Path]:
    """`count` photo-like JPEGs, each scaled down to `max_side` px where longer."""
    rng = random.Random(seed)
    paths = []
    for index in range(count):
        exif = Image.Exif()
        if rng.random() < 0.25:
            exif[ORIENTATION_TAG] = rng.randint(2, 8)
        path = folder / f"photo_{index:05d}.jpg"
        photo_like(*photo_size(rng, max_side), rng).save(path, "JPEG", quality=90, exif=exif)
        paths.append(path)
    return paths


def simplejpeg_decoder() -> JpegDecoder:
    """simplejpeg (a dev extra); raises when it is missing."""
    import simplejpeg

    def decode(data: bytes, size: tuple[int, int]) -> np.ndarray:
        # strict: a truncated or corrupt file raises instead of decoding to grey, as Pillow does
        return simplejpeg.decode_jpeg(data, "RGB", min_width=size[0], min_height=size[1], strict=True)

    return decode


def turbojpeg_decoder() -> JpegDecoder:
    """PyTurboJPEG at the scale simplejpeg would choose; raises when it or the system's
    libturbojpeg is missing."""
    from turbojpeg import TJPF_RGB, TurboJPEG

    jpeg = TurboJPEG()

    def decode(data: bytes, size: tuple[int, int]) -> np.ndarray:
        width, height, *_ = jpeg.decode_header(data)
        fits = (s for s in (8, 4, 2) if -(-width // s) >= size[0] and -(-height // s) >= size[1])
        return jpeg.decode(data, pixel_format=TJPF_RGB, scaling_factor=(1, next(fits, 1)))

    return decode


# name -> a maker of its decoder (None: Pillow's own, drafting)
DECODERS: dict[str, Callable[[], JpegDecoder | None]] = {
    PILLOW: lambda: None,
    "simplejpeg": simplejpeg_decoder,
    "pyturbojpeg": turbojpeg_decoder,
}


def available_decoders(names: list[str]) -> tuple[dict[str, JpegDecoder | None], dict[str, str]]:
    """The decoders of `names` that load here, and why the others do not."""
    loaded, missing = {}, {}
    for name in names:
        try:
            loaded[name] = DECODERS[name]()
        except (ImportError, RuntimeError, OSError) as error:
            missing[name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return loaded, missing


def jpegs_under(folder: Path, count: int) -> tuple[list[Path], int]:
    """The first `count` readable JPEG files under `folder`, as training finds image files
    (hidden files and broken links skipped), and how many JPEG-named files did not open as
    one: training skips such files, where they failed the benchmark in a traceback."""
    jpegs, unreadable = [], 0
    for path in image_files_under(folder):
        if len(jpegs) == count:
            break
        if path.suffix.lower() not in {".jpg", ".jpeg"}:
            continue
        try:
            with opened(str(path)) as image:
                readable = image.format == "JPEG"
        except OSError:
            readable = False
        if readable:
            jpegs.append(path)
        else:
            unreadable += 1
    return jpegs, unreadable


def make_samples(paths: list[Path], max_patches: int, decoder: JpegDecoder | None) -> list[ImageSample]:
    samples = []
    for path in paths:
        with opened(str(path)) as image:  # as training decodes it, at any size
            samples.append(image_to_sample(image, 0, PATCH_SIZE, max_patches, True, decoder))
    return samples


@dataclass
class Figure:
    decoder: str
    max_patches: int
    images_per_s: float
    ratio: float
    grids_equal: bool
    max_abs_diff: int
    mean_abs_diff: float


def difference(samples: list[ImageSample], reference: list[ImageSample]) -> tuple[bool, int, float]:
    """(every grid and coordinate equal, max and mean absolute pixel difference)."""
    pairs = list(zip(samples, reference, strict=True))
    if any(s.grid != r.grid or not torch.equal(s.coords, r.coords) for s, r in pairs):
        return False, 255, float("nan")
    diffs = [(s.patches.int() - r.patches.int()).abs() for s, r in pairs]
    total = sum(int(d.sum()) for d in diffs) / sum(d.numel() for d in diffs)
    return True, max(int(d.max()) for d in diffs), total


def measure(
    paths: list[Path], decoders: dict[str, JpegDecoder | None], max_patches: int, rounds: int
) -> list[Figure]:
    for decoder in decoders.values():  # warm: the files in the page cache, the libraries loaded
        make_samples(paths, max_patches, decoder)
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(rounds):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            make_samples(paths, max_patches, decoder)
            rates[name].append(len(paths) / (time.perf_counter() - start))
    reference = make_samples(paths, max_patches, None)
    pillow_rate = statistics.median(rates[PILLOW]) if PILLOW in rates else float("nan")
    figures = []
    for name, decoder in decoders.items():
        rate = statistics.median(rates[name])
        match = difference(make_samples(paths, max_patches, decoder), reference)
        figures.append(Figure(name, max_patches, rate, rate / pillow_rate, *match))
    return figures


def table(figures: list[Figure]) -> str:
    columns = ["decoder", "patches", "images/s per worker", "ratio to pillow+draft", "grids equal"]
    lines = ["| " + " | ".join([*columns, "max / mean abs diff"]) + " |", "|---|---|---|---|---|---|"]
    for f in figures:
        lines.append(
            f"| {f.decoder} | {f.max_patches} | {f.images_per_s:,.0f} | {f.ratio:.2f}x | "
            f"{'yes' if f.grids_equal else 'NO'} | {f.max_abs_diff} / {f.mean_abs_diff:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", type=Path, help="JPEG files to decode (default: write photo-like ones)")
    parser.add_argument(
        "--count", type=at_least_one, default=300, help="photo-like files to write, or to take"
    )
    parser.add_argument(
        "--max-side",
        type=at_least_one,
        help="photo-like files no longer than this (500: ImageNet-like; or a resized copy)",
    )
    parser.add_argument(
        "--budgets", type=at_least_one, nargs="+", default=[36, 256], help="max patches per image"
    )
    parser.add_argument("--decoders", nargs="+", choices=DECODERS, default=list(DECODERS))
    parser.add_argument(
        "--rounds", type=at_least_one, default=5, help="timed passes over the folder per decoder"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.folder and not args.folder.is_dir():
        parser.error(f"--folder {args.folder} is not a folder: name one of JPEG files, or leave it out")

    torch.set_num_threads(1)  # as in a DataLoader worker
    decoders, missing = available_decoders(args.decoders)
    for name, reason in missing.items():
        print(f"{name}: not measured ({reason})")
    with tempfile.TemporaryDirectory() as temporary:
        if args.folder:
            paths, unreadable = jpegs_under(args.folder, args.count)
            if unreadable:
                print(f"--folder {args.folder}: skipped {unreadable} .jpg or .jpeg file(s), no readable JPEG")
            if not paths:
                parser.error(
                    f"--folder {args.folder} holds no JPEG files (.jpg, .jpeg): the decoders read JPEGs"
                )
        else:
            paths = write_photo_folder(Path(temporary), args.count, args.max_side)
        print(
            f"{len(paths)} JPEG files, {sum(p.stat().st_size for p in paths) / len(paths) / 1e3:.0f} kB each"
        )
        figures = [f for budget in args.budgets for f in measure(paths, decoders, budget, args.rounds)]
    load = os.getloadavg()
    print(table(figures))
    print(f"load average (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        record = {"figures": [asdict(f) for f in figures], "missing": missing, "load_average": load}
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
