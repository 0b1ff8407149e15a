"""The built-in data set: geometric shapes on noisy, cluttered backgrounds, generated
offline as ordinary image files (PNG and JPEG) in class folders, at many native
resolutions and aspect ratios, so that the default run takes the same code path as a
folder of real photos."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from navit_lightning.data.workers import map_with_progress
from navit_lightning.errors import ConfigError, DataError, free_space, is_whole, require_counts, space_advice

log = logging.getLogger(__name__)

CLASSES = ("circle", "square", "triangle", "cross", "star", "ring")
SPLIT_SEED_OFFSET = {"train": 0, "val": 1_000_000, "test": 2_000_000}
DONE_MARKER = "shapes.json"
# Beside the set while it is written (a folder with neither marker is not the generator's),
# and the lock that lets one process write it.
STARTED_MARKER = ".shapes_started"
LOCK_NAME = ".shapes.lock"
GENERATED_NAME = re.compile(r"\d{6}\.(png|jpg)")
# Raised when the same spec draws other images: a finished copy of an older version is redrawn.
GENERATOR_VERSION = 2


@dataclass(frozen=True)
class ShapesSpec:
    num_train: int = 20000
    num_val: int = 1000
    num_test: int = 1000
    min_side: int = 40
    max_side: int = 192
    max_aspect: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        prefix = "data.generate"
        counts = {"num_train": self.num_train, "num_val": self.num_val, "num_test": self.num_test}
        require_counts(prefix, **counts)
        for split, count in counts.items():
            if count < len(CLASSES):  # a class folder without an image can neither train nor score
                raise ConfigError(
                    f"{prefix}.{split}={count} must be at least {len(CLASSES)}: an image of each class"
                )
        require_counts(prefix, min_side=self.min_side, max_side=self.max_side)
        if self.min_side > self.max_side:
            raise ConfigError(f"{prefix}.min_side={self.min_side} must not be above max_side={self.max_side}")
        if (
            isinstance(self.max_aspect, bool)
            or not isinstance(self.max_aspect, (int, float))
            or not 1 <= self.max_aspect < math.inf  # nan too
        ):
            raise ConfigError(
                f"{prefix}.max_aspect={self.max_aspect} must be 1 or above (2 allows 2:1 and 1:2)"
            )
        if not is_whole(self.seed):
            raise ConfigError(f"{prefix}.seed={self.seed} must be a whole number")


def folder_name(settings: Mapping[str, Any] | None) -> str:
    """The folder in paths.data_dir of the set that `settings` (data.generate) make, the Hydra
    resolver `shapes_folder`: `shapes` for the default set, `shapes-<hash of the settings>` for
    another, so that a run of other settings never replaces a set that another run reads."""
    defaults = asdict(ShapesSpec())
    chosen = {**defaults, **{key: value for key, value in dict(settings or {}).items() if key != "_target_"}}
    if chosen == defaults:
        return "shapes"
    # 2 and 2.0 are one setting; a value of another type is refused when the spec is built
    numbers = {
        key: float(value) if isinstance(value, (int, float)) else str(value) for key, value in chosen.items()
    }
    return "shapes-" + hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:8]


# configs/data/shapes.yaml names its root with it.
OmegaConf.register_new_resolver(
    "shapes_folder",
    lambda settings: folder_name(OmegaConf.to_container(settings, resolve=True) if settings else None),
    replace=True,
)


def _polygon(cx: float, cy: float, radii: list[float], angle: float) -> list[tuple[float, float]]:
    step = 2 * math.pi / len(radii)
    return [
        (cx + r * math.cos(angle + i * step), cy + r * math.sin(angle + i * step))
        for i, r in enumerate(radii)
    ]


def _draw_shape(
    draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, angle: float, fill: tuple
) -> None:
    if name == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif name == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=fill, width=max(2, round(r * 0.3)))
    elif name == "square":
        draw.polygon(_polygon(cx, cy, [r] * 4, angle), fill=fill)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, [r] * 3, angle), fill=fill)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, [r, r * 0.4] * 5, angle), fill=fill)
    elif name == "cross":
        arm = r * 0.35
        for theta in (angle, angle + math.pi / 2):
            dx, dy = math.cos(theta), math.sin(theta)
            ex, ey = -dy * arm, dx * arm  # half the arm's width, across it
            draw.polygon(
                [
                    (cx - r * dx + ex, cy - r * dy + ey),
                    (cx + r * dx + ex, cy + r * dy + ey),
                    (cx + r * dx - ex, cy + r * dy - ey),
                    (cx - r * dx - ex, cy - r * dy - ey),
                ],
                fill=fill,
            )
    else:
        raise ValueError(f"unknown shape {name!r}")


def render(label: int, rng: random.Random, spec: ShapesSpec) -> Image.Image:
    """One image of CLASSES[label] at a random size and aspect ratio."""
    side = math.exp(rng.uniform(math.log(spec.min_side), math.log(spec.max_side)))
    aspect = math.exp(rng.uniform(-math.log(spec.max_aspect), math.log(spec.max_aspect)))
    width = max(spec.min_side, round(side * math.sqrt(aspect)))
    height = max(spec.min_side, round(side / math.sqrt(aspect)))
    dark_background = rng.random() < 0.5
    background = tuple(rng.randint(0, 90) if dark_background else rng.randint(165, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    short = min(width, height)
    for _ in range(rng.randint(0, 6)):  # clutter: thin lines and dots well below the shape's size
        x, y = rng.uniform(0, width), rng.uniform(0, height)
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        if rng.random() < 0.5:
            draw.line(
                (x, y, x + rng.uniform(-short, short) / 3, y + rng.uniform(-short, short) / 3),
                fill=colour,
                width=1,
            )
        else:
            d = max(1.0, short * 0.04)
            draw.ellipse((x - d, y - d, x + d, y + d), fill=colour)
    r = short * rng.uniform(0.35, 0.48)
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    foreground = tuple(rng.randint(170, 255) if dark_background else rng.randint(0, 85) for _ in range(3))
    _draw_shape(draw, CLASSES[label], cx, cy, r, rng.uniform(0, 2 * math.pi), foreground)
    # Drawn from the image's own seed: Pillow's effect_noise uses the C library's generator,
    # whose state depends on which pool process drew which images before.
    noise = np.random.default_rng(rng.getrandbits(64)).normal(128, rng.uniform(10, 40), (height, width))
    noise_image = Image.fromarray(noise.clip(0, 255).astype(np.uint8)).convert("RGB")
    return Image.blend(image, noise_image, rng.uniform(0.05, 0.25))


def _write_one(job: tuple[Path, int, int, ShapesSpec]) -> None:
    root, index, seed, spec = job
    rng = random.Random(seed)
    label = index % len(CLASSES)
    image = render(label, rng, spec)
    stem = root / CLASSES[label] / f"{index:06d}"
    if index % 4:  # both common formats, as in a real photo folder (JPEG is the smaller)
        image.save(stem.with_suffix(".jpg"), quality=92)
    else:
        image.save(stem.with_suffix(".png"))


def generate(root: str | Path, spec: ShapesSpec = ShapesSpec(), workers: int = 2) -> Path:
    """Write root/{train,val,test}/<class>/*.{png,jpg} unless a finished copy of this spec is
    there. One process at a time: another (a sweep's job, a node on a shared file system)
    waits for its set."""
    root = Path(root)
    if made_here(root) == finished_marker(spec):  # no lock: the folder may be read-only
        return root
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process that is generating the shapes data set in %s", root)
        lock.acquire()
    try:
        if made_here(root) != finished_marker(spec):
            _write_set(root, spec, workers)
    finally:
        lock.release()
    return root


def refuse_a_folder_of_other_files(root: Path) -> None:
    """Refuse `root` for the built-in set where it holds files this generator did not write
    (data.root=<a folder of the user's own> without data=imagefolder): its class folders
    named like shapes would be replaced."""
    if (
        root.is_dir()
        and not (root / DONE_MARKER).exists()
        and not (root / STARTED_MARKER).exists()
        and not only_shapes_files(root)
    ):
        raise DataError(
            f"{root} holds files that the built-in data set did not write: to train on them use "
            f"data=imagefolder data.root={root}; for the built-in set give an empty or new folder"
        )


def _write_set(root: Path, spec: ShapesSpec, workers: int) -> None:
    refuse_a_folder_of_other_files(root)
    marker, started = root / DONE_MARKER, root / STARTED_MARKER
    started.touch()
    marker.unlink(missing_ok=True)
    counts = {"train": spec.num_train, "val": spec.num_val, "test": spec.num_test}
    jobs = []
    start = time.perf_counter()
    try:
        for split, count in counts.items():
            for name in CLASSES:
                # Another spec's (or an interrupted run's) images would mix with these.
                shutil.rmtree(root / split / name, ignore_errors=True)
                (root / split / name).mkdir(parents=True)
            jobs += [(root / split, i, spec.seed + SPLIT_SEED_OFFSET[split] + i, spec) for i in range(count)]
        for _ in map_with_progress(
            _write_one, jobs, f"Generating the shapes data set in {root}", workers, 64
        ):
            pass
    except OSError as error:  # a full disk: Pillow's and the pool's chained tracebacks, naming nothing
        raise DataError(
            f"the built-in data set cannot be written in {root} ({error.strerror or error}; "
            f"{free_space(root / 'train')}): {space_advice(error)}give paths.data_dir=<another folder>"
        ) from None
    marker.write_text(json.dumps(finished_marker(spec)))
    started.unlink()
    # the progress bar reaches the console alone (in a pipe, as one line cut at its end)
    log.info(
        "generated the shapes data set in %s: %s images in %.1f s",
        root,
        " + ".join(f"{count} {split}" for split, count in counts.items()),
        time.perf_counter() - start,
    )


def only_shapes_files(root: Path) -> bool:
    """Whether every visible file under root is one of this generator's (split/class/NNNNNN
    .png or .jpg): a set that a version without STARTED_MARKER began and was interrupted in."""
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if any(part.startswith(".") for part in parts):  # the lock, a manifest
            continue
        if parts[0] not in SPLIT_SEED_OFFSET or (len(parts) > 1 and parts[1] not in CLASSES):
            return False
        if len(parts) > 2 and not (len(parts) == 3 and GENERATED_NAME.fullmatch(parts[2])):
            return False
    return True


def finished_marker(spec: ShapesSpec) -> dict[str, Any]:
    """What a finished set of `spec` records in its DONE_MARKER."""
    return {**asdict(spec), "generator": GENERATOR_VERSION}


def made_here(root: Path) -> dict[str, Any] | None:
    """The DONE_MARKER of the finished set in `root`, if one is."""
    marker = root / DONE_MARKER
    return json.loads(marker.read_text()) if marker.exists() else None


def root_for_run(run_root: str, data_dir: str, spec: Mapping[str, Any]) -> str:
    """Where eval.py reads a run's built-in set (`spec`, its data.generate): the run's own
    folder where it is there; else, or where another set has replaced it there since, this
    machine's data_dir/<the spec's folder> (a run from another clone or machine, or from
    before each spec had its own folder; the same images, from their seed). Never a folder
    that holds another finished set: making this one would replace it under whatever reads
    it (a run training on it)."""
    wanted = finished_marker(ShapesSpec(**{key: value for key, value in spec.items() if key != "_target_"}))
    own = Path(run_root).expanduser()
    here = Path(data_dir) / folder_name(spec)
    for root in (own, here) if own.is_dir() else (here,):
        made = made_here(root)
        if made is None or made == wanted:  # the run's set, or none finished to replace
            return str(root)
    changed = ", ".join(f"{key}={made[key]} there" for key in sorted(made) if made[key] != wanted.get(key))
    where = "holds another set now" if own.is_dir() else "is not on this machine"
    beside = "" if here == own else f", and {here} holds another set"
    raise DataError(
        f"the run's built-in data ({run_root}) {where}{beside} ({changed}): set paths.data_dir to a "
        "folder where eval.py may make the run's"
    )
