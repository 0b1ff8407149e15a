"""image_to_sample with another JPEG decoder (simplejpeg, as bench.decoders measures it)
against Pillow's path, and the decoder benchmark."""

import io
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from navit_lightning.bench import decoders as bench
from navit_lightning.data.folder import UNREADABLE
from navit_lightning.data.packing import ImageSample
from navit_lightning.data.transforms import ORIENTATION_TAG, fit_grid, image_to_sample, upright_size

pytest.importorskip("simplejpeg")  # a dev extra
SIMPLEJPEG = bench.simplejpeg_decoder()


class CountingDecoder:
    """simplejpeg, counting the files it decodes, so a test knows it was used."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data: bytes, size: tuple[int, int]) -> np.ndarray:
        self.calls += 1
        return SIMPLEJPEG(data, size)


def photo_bytes(width: int, height: int, orientation: int = 1, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    """A photo-like image: no symmetry, so a wrong turn or mirror shows in every pixel."""
    image = bench.photo_like(width, height, random.Random(width * height + orientation)).convert(mode)
    exif = Image.Exif()
    if orientation != 1:
        exif[ORIENTATION_TAG] = orientation
    # An MPO holds two pictures (one would be saved as a plain JPEG); the first is the photo.
    second = {"save_all": True, "append_images": [image.rotate(90)]} if fmt == "MPO" else {}
    buffer = io.BytesIO()
    image.save(buffer, fmt, quality=90, exif=exif, **second)
    return buffer.getvalue()


def sample_of(data: bytes, max_patches: int, mirror: bool, decoder) -> ImageSample:
    with Image.open(io.BytesIO(data)) as image:
        return image_to_sample(image, 7, 16, max_patches, mirror, decoder)


def assert_same_sample(other: ImageSample, pillow: ImageSample) -> None:
    assert other.grid == pillow.grid and other.label == pillow.label
    assert other.coords.tolist() == pillow.coords.tolist()
    # Both use libjpeg-turbo's scaled IDCT; other builds may round a few values differently.
    difference = (other.patches.int() - pillow.patches.int()).abs()
    assert int(difference.max()) <= 8 and float(difference.float().mean()) < 0.5


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("mirror", [False, True])
def test_simplejpeg_path_turns_and_mirrors_as_pillow(orientation, mirror):
    data = photo_bytes(331, 207, orientation)  # odd sides: the reduced sizes round up
    decoder = CountingDecoder()
    other = sample_of(data, 36, mirror, decoder)
    assert decoder.calls == 1
    assert_same_sample(other, sample_of(data, 36, mirror, None))


@pytest.mark.parametrize("max_patches", [4, 36, 256, 1024])  # draft scales 1/8 .. 1
def test_simplejpeg_path_matches_pillow_at_every_draft_scale(max_patches):
    data = photo_bytes(1203, 801, orientation=6)
    with Image.open(io.BytesIO(data)) as image:
        grid = fit_grid(*upright_size(image), 16, max_patches)
    other = sample_of(data, max_patches, False, CountingDecoder())
    assert other.grid == grid
    assert_same_sample(other, sample_of(data, max_patches, False, None))


@pytest.mark.parametrize("fmt", ["JPEG", "MPO"])
def test_grey_and_multi_picture_jpegs_take_the_simplejpeg_path(fmt):
    data = photo_bytes(200, 120, orientation=3, mode="L" if fmt == "JPEG" else "RGB", fmt=fmt)
    assert Image.open(io.BytesIO(data)).format == fmt
    decoder = CountingDecoder()
    assert_same_sample(sample_of(data, 36, True, decoder), sample_of(data, 36, True, None))
    assert decoder.calls == 1


@pytest.mark.parametrize(("mode", "fmt"), [("RGB", "PNG"), ("CMYK", "JPEG"), ("RGB", "WEBP")])
def test_other_files_go_through_pillow(mode, fmt):
    data = photo_bytes(120, 90, orientation=8, mode=mode, fmt=fmt)
    decoder = CountingDecoder()
    other = sample_of(data, 36, False, decoder)
    assert decoder.calls == 0
    pillow = sample_of(data, 36, False, None)
    assert other.grid == pillow.grid and other.patches.equal(pillow.patches)


@pytest.mark.parametrize("keep", [0.2, 0.6, 0.95])
def test_a_truncated_jpeg_fails_as_pillow_fails_it(keep):
    data = photo_bytes(640, 480)
    data = data[: int(len(data) * keep)]
    with pytest.raises(UNREADABLE) as other:
        sample_of(data, 36, False, SIMPLEJPEG)
    with pytest.raises(UNREADABLE) as pillow:
        sample_of(data, 36, False, None)
    assert type(other.value) is type(pillow.value) and str(other.value) == str(pillow.value)


def test_a_file_the_decoder_refuses_is_decoded_by_pillow():
    def refuse(data: bytes, size: tuple[int, int]) -> np.ndarray:
        raise ValueError("Corrupt JPEG data: 3 extraneous bytes before marker")  # strict mode's

    data = photo_bytes(300, 200, orientation=5)
    sample = sample_of(data, 36, True, refuse)
    assert sample.patches.equal(sample_of(data, 36, True, None).patches)


def test_the_benchmark_measures_every_decoder_on_photo_like_files(tmp_path: Path):
    sizes = {bench.photo_size(random.Random(seed), None) for seed in range(100)}
    assert {(2048, 1536), (1536, 2048)} <= sizes  # camera sizes in both orientations, as they are
    paths = bench.write_photo_folder(tmp_path, 6, max_side=300)
    assert all(max(Image.open(p).size) <= 300 for p in paths)
    loaded, missing = bench.available_decoders([bench.PILLOW, "simplejpeg", "pyturbojpeg"])
    assert {bench.PILLOW, "simplejpeg"} <= loaded.keys() and set(loaded) | set(missing) == {
        bench.PILLOW,
        "simplejpeg",
        "pyturbojpeg",
    }
    figures = bench.measure(paths, loaded, 36, rounds=1)
    assert [f.decoder for f in figures] == list(loaded)
    assert figures[0].ratio == 1.0 and all(f.grids_equal and f.images_per_s > 0 for f in figures)
    assert "| simplejpeg | 36 |" in bench.table(figures)


def test_a_folder_without_jpegs_is_refused_with_one_line(tmp_path: Path):
    """It divided by the number of JPEG files: a ZeroDivisionError."""
    Image.new("RGB", (8, 8)).save(tmp_path / "only.png")
    result = subprocess.run(
        [sys.executable, "-m", "navit_lightning.bench.decoders", "--folder", str(tmp_path), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        result.returncode == 2 and "holds no JPEG files" in result.stderr and "Traceback" not in result.stderr
    )


def test_a_folders_jpegs_are_found_as_training_finds_them_and_the_unreadable_counted(tmp_path: Path):
    """An empty .jpg, a PNG named .jpg, a broken link and a macOS ._ file failed the benchmark
    in a traceback, where training skips them."""
    for name in ("b/1.jpg", "a/2.JPEG", "a/nested/3.jpg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / name, format="JPEG")
    (tmp_path / "a" / "empty.jpg").write_bytes(b"")
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "png.jpg", format="PNG")
    (tmp_path / "a" / "._2.jpg").write_bytes(b"\0" * 10)
    (tmp_path / "a" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    found, unreadable = bench.jpegs_under(tmp_path, count=10)
    assert [path.relative_to(tmp_path).as_posix() for path in found] == [
        "a/2.JPEG",
        "a/nested/3.jpg",
        "b/1.jpg",
    ]
    assert unreadable == 2
    assert bench.jpegs_under(tmp_path, count=2)[0] == found[:2]
