"""Image -> patches at (close to) native resolution under a patch budget."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import IO

import numpy as np
import torch
from einops import rearrange
from PIL import Image, UnidentifiedImageError

from navit_lightning.data.packing import ImageSample

# Pillow's guard against decompression bombs: the largest image it opens (twice its
# MAX_IMAGE_PIXELS), data.max_image_pixels's default
PILLOW_MAX_PIXELS = 178_956_970
# Pillow's formats of the files taken for images (index.IMAGE_SUFFIXES), which it opens
# from their header alone
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP", "AVIF", "PPM")


@contextlib.contextmanager
def opened(file: str | IO[bytes]) -> Iterator[Image.Image]:
    """The image in `file`, opened and decoded inside the block. One of IMAGE_FORMATS at any
    size: how large an image may be is data.max_image_pixels, checked from the header before
    any decode (folder.within_pixels), which names each file it leaves out; Pillow's own guard
    refused images over 179 MP with no setting to read them, and warned of those over 89 MP
    without naming the file, once in each loader worker. Another format under an image's
    name (a JPEG 2000 named .jpg) within Pillow's guard: some decode whole as they open, an
    ICO named .png of 194 KB into 1.8 GB."""
    with contextlib.ExitStack() as stack:
        if isinstance(file, str):  # opened once for both tries
            file = stack.enter_context(open(file, "rb"))
        try:
            with _at_any_size():
                image = Image.open(file, formats=IMAGE_FORMATS)
            size_guard: contextlib.AbstractContextManager = _at_any_size()
        except UnidentifiedImageError:
            file.seek(0)
            image = Image.open(file)
            size_guard = contextlib.nullcontext()
        with size_guard, image:
            yield image


class _PillowGuard:
    """Pillow's size guard (Image.MAX_IMAGE_PIXELS, one setting for the process), lifted while
    any thread is inside `lifted()` and restored as the last one leaves: a thread that left
    first put it back under another's decode, and the other then lifted it for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._kept: int | None = None

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        with self._lock:
            if not self._inside:
                self._kept, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    Image.MAX_IMAGE_PIXELS = self._kept


_at_any_size = _PillowGuard().lifted


ORIENTATION_TAG = 0x0112
# EXIF orientation -> the transpose that turns the stored pixels upright; 5..8 swap the sides
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SIDES_SWAPPED = {5, 6, 7, 8}


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation still to apply to `image` (1: none)."""
    # A PNG's getexif() decodes all its pixels to look for EXIF after them (measured: 10x the
    # header read); EXIF before the pixels, where writers put it, is read with the header.
    # Pillow (from 11) turns TIFFs upright itself: their size is upright, load() turns them.
    if (image.format == "PNG" and "exif" not in image.info) or image.format == "TIFF":
        return 1
    return image.getexif().get(ORIENTATION_TAG, 1)


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) once the EXIF orientation is applied, read without decoding."""
    if exif_orientation(image) in SIDES_SWAPPED:
        return image.width, image.height
    return image.height, image.width


def fit_grids(
    heights: np.ndarray, widths: np.ndarray, patch_size: int, max_patches: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, cols) patch grids closest to (images,) images' own sizes, aspect ratio
    kept, with at most max_patches patches and at least one patch per side: (images,) rows
    and (images,) columns. The sampler sizes a whole epoch's images at once with it."""
    grid_h, grid_w = rounded_grids(heights, widths, patch_size, max_patches)
    over = np.flatnonzero(grid_h * grid_w > max_patches)  # rounding up overshot by a row
    while len(over):
        taller = grid_h[over] >= grid_w[over]
        grid_h[over[taller]] -= 1
        grid_w[over[~taller]] -= 1
        over = over[grid_h[over] * grid_w[over] > max_patches[over]]
    return grid_h, grid_w


def rounded_grids(
    heights: np.ndarray, widths: np.ndarray, patch_size: int, max_patches: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """fit_grids before it takes a side down where rounding overshot max_patches: no smaller
    than its grids, and no smaller at a larger max_patches."""
    scale = np.minimum(1.0, np.sqrt(max_patches * patch_size**2 / (heights * widths)))
    grid_h = np.maximum(1, np.rint(heights * scale / patch_size)).astype(np.int64)
    grid_w = np.maximum(1, np.rint(widths * scale / patch_size)).astype(np.int64)
    return grid_h, grid_w


def longest_side(heights: np.ndarray, widths: np.ndarray, patch_size: int, budgets: range) -> tuple[int, int]:
    """The most patches along a side of any of the images at any of the patch `budgets`, and
    the index of an image that long (-1 for no image). Not always at the largest budget (a
    338 x 25 px image is 2 x 18 patches of 16 px at 36, 1 x 20 at 30): the smaller budgets are
    tried only on the images that rounded_grids allows longer."""

    def longest_at(budget: int, images: np.ndarray) -> tuple[int, int]:
        grid_h, grid_w = fit_grids(heights[images], widths[images], patch_size, np.full(len(images), budget))
        sides = np.maximum(grid_h, grid_w)
        if not len(sides):
            return 0, -1
        at = int(sides.argmax())
        return int(sides[at]), int(images[at])

    longest = longest_at(budgets[-1], np.arange(len(heights)))
    bound_h, bound_w = rounded_grids(heights, widths, patch_size, budgets[-1])
    maybe_longer = np.flatnonzero(np.maximum(bound_h, bound_w) > longest[0])
    for budget in budgets[:-1] if len(maybe_longer) else ():
        longest = max(longest, longest_at(budget, maybe_longer), key=lambda side: side[0])
    return longest


def fit_grid(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """fit_grids for one image."""
    grid_h, grid_w = fit_grids(np.array([height]), np.array([width]), patch_size, np.array([max_patches]))
    return int(grid_h[0]), int(grid_w[0])


# how far outside [0, 1] or [0, 255] float values may lie, relatively, and still be read in it
FLOAT_ROUNDING = 1e-3
WIDE_GREY_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}


def grey_scaling(image: Image.Image) -> tuple[float, float]:
    """(offset, factor): (value - offset) * factor takes a wide grey image ("I" or "F") to 8
    bits. Whole numbers as 16 bits, floats in [0, 1] or [0, 255] as such (a resampling's
    rounding just outside them clipped); other values (signed, 32-bit, wide floats, which those
    would clip to black or white) by the range of the image's finite values."""
    low, high = image.getextrema()
    if image.mode == "I":
        if low >= 0 and high <= 65535:
            return 0.0, 1 / 256
    else:
        if not (math.isfinite(low) and math.isfinite(high)):  # NaN or inf in it: read without them
            values = np.asarray(image)
            finite = values[np.isfinite(values)]
            low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        for top in (1.0, 255.0):
            if -FLOAT_ROUNDING * top <= low and high <= (1 + FLOAT_ROUNDING) * top:
                return 0.0, 255 / top
    if high == low:  # one value outside those: no range to scale by
        return low - 127.5, 1.0
    return low, 255 / (high - low)


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow image as 8-bit RGB: transparency (an alpha band, or a PNG's transparent
    colour) laid over white, wide grey (16/32-bit, float) scaled to 8 bits by grey_scaling (a
    plain convert clipped 16 bits to white, and made floats in [0, 1] black)."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode in WIDE_GREY_MODES:
        # through "I": Pillow's point() refuses the 16-bit modes of either byte order
        wide = image if image.mode == "F" else image.convert("I")
        transparent = image.info.get("transparency")
        offset, factor = grey_scaling(wide)
        image = wide.point(lambda value: (value - offset) * factor).convert("L")
        if transparent is not None:  # a 16-bit grey: matched before the scaling to 8 bits
            image.info.pop("transparency", None)
            image.putalpha(
                Image.fromarray(np.where(np.asarray(wide) == transparent, 0, 255).astype(np.uint8))
            )
    if image.mode in ("P", "L", "RGB") and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    return image.convert("RGB")


# Another JPEG library in Pillow's place: (file bytes, smallest (width, height)) -> (height,
# width, 3) uint8 RGB pixels, decoded at the largest DCT reduction (1/2 .. 1/8) that keeps
# both sides at least that size; raises ValueError or OSError on data it cannot decode.
# None, the loader's choice: Pillow. simplejpeg and PyTurboJPEG were no faster at the
# loader's reduced scales (all three are libjpeg-turbo; docs/benchmarks.md, "Decoding").
JpegDecoder = Callable[[bytes, tuple[int, int]], np.ndarray]
# MPO: a camera JPEG with a multi-picture index, its first picture is the photo. CMYK and
# other modes: Pillow converts them.
JPEG_DECODER_FORMATS = {"JPEG", "MPO"}
JPEG_DECODER_MODES = {"RGB", "L"}


def decode_rgb(image: Image.Image, size: tuple[int, int], jpeg_decoder: JpegDecoder | None) -> Image.Image:
    """The image as 8-bit RGB, in its stored orientation; a JPEG decoded at the smallest
    1/2 .. 1/8 scale that keeps it at least `size` (Pillow's draft mode), by `jpeg_decoder`
    when given. Anything else, or a file the decoder cannot read, goes through Pillow, so a
    corrupt file fails as Pillow fails it."""
    image.draft("RGB", size)  # reads no pixels: sets image.size to the reduced size
    fp = getattr(image, "fp", None)
    if jpeg_decoder and image.format in JPEG_DECODER_FORMATS and image.mode in JPEG_DECODER_MODES and fp:
        with contextlib.suppress(ValueError, OSError):
            fp.seek(0)  # where Image.open started reading; Pillow seeks back when it decodes
            return Image.fromarray(jpeg_decoder(fp.read(), image.size))
    return to_rgb(image)


def image_to_sample(
    image: Image.Image,
    label: int,
    patch_size: int,
    max_patches: int,
    mirror: bool = False,
    jpeg_decoder: JpegDecoder | None = None,
) -> ImageSample:
    """Resize to the fitted grid, turn upright (EXIF orientation), mirror left-right if asked,
    and cut into flattened uint8 patches in (p1 p2 c) order. `image` is opened, not yet
    decoded (Image.open); JPEGs are decoded by `jpeg_decoder` (None: by Pillow)."""
    orientation = exif_orientation(image)
    height, width = upright_size(image)
    grid_h, grid_w = fit_grid(height, width, patch_size, max_patches)
    size = (grid_w * patch_size, grid_h * patch_size)
    # Resized before it is turned, the smaller image: in the stored orientation.
    stored_size = size[::-1] if orientation in SIDES_SWAPPED else size
    image = decode_rgb(image, stored_size, jpeg_decoder)
    if image.size != stored_size:
        image = image.resize(stored_size, Image.Resampling.BICUBIC, reducing_gap=3.0)
    if orientation in UPRIGHT:
        image = image.transpose(UPRIGHT[orientation])
    if mirror:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.array(image))  # (height, width, 3)
    patches = rearrange(pixels, "(h p1) (w p2) c -> (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)
    index = torch.arange(grid_h * grid_w)
    coords = torch.stack([index // grid_w, index % grid_w], dim=1)  # (row, col), row-major
    return ImageSample(patches, coords, (grid_h, grid_w), label)


def drop_tokens(sample: ImageSample, keep: int, seed: int) -> ImageSample:
    """Keep `keep` of the sample's patches, chosen by `seed`, in their original order."""
    if keep >= len(sample.patches):
        return sample
    rng = np.random.default_rng(seed)
    kept = torch.from_numpy(np.sort(rng.choice(len(sample.patches), size=keep, replace=False)))
    return sample._replace(patches=sample.patches[kept], coords=sample.coords[kept])
