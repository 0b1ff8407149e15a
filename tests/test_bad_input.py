"""Real image folders are messy: every kind of image converts, bad files are skipped and
counted, and a root that cannot train is refused with one line."""

import io
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from einops import rearrange
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from PIL import Image, ImageOps

from navit_lightning.batch import PackedShape
from navit_lightning.data import folder
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.folder import ImageFolder, split_images, warn_unreadable
from navit_lightning.data.index import index_folder, read_size
from navit_lightning.data.packing import PackCollate
from navit_lightning.data.sampler import SizePolicy
from navit_lightning.data.transforms import image_to_sample, opened, to_rgb, upright_size
from navit_lightning.errors import DataError
from navit_lightning.utils.callbacks import UnreadableImageReport
from tests.conftest import TINY_TRAINING, on_two_gloo_ranks, run_folder

CORRUPT = Path(__file__).parent / "data" / "corrupt"

EXIF_ORIENTATION = 0x0112


def save(image: Image.Image, path, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kwargs)
    return path


def with_info(image: Image.Image, **info) -> Image.Image:
    image.info.update(info)
    return image


def rotated_jpeg() -> bytes:
    """A 40 x 20 (w x h) JPEG whose EXIF says: turn 90 degrees to show it upright (20 x 40)."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20), (200, 30, 30)).save(buffer, "JPEG", exif=exif)
    return buffer.getvalue()


def make_messy_folder(root):
    """Two classes of good images of every kind, plus the bad files users have."""
    good = {
        "rgb.png": Image.new("RGB", (64, 48), (10, 200, 10)),
        "grey.png": Image.new("L", (50, 70), 128),
        "palette.gif": Image.new("P", (33, 33), 3),
        "rgba.png": Image.new("RGBA", (40, 40), (255, 0, 0, 0)),
        "cmyk.jpg": Image.new("CMYK", (48, 32), (0, 255, 255, 0)),
        "deep.png": Image.new("I;16", (32, 32), 60000),
        "tiny.png": Image.new("RGB", (3, 2), (1, 2, 3)),
        "huge.jpg": Image.new("RGB", (3000, 2000), (90, 90, 200)),
    }
    for cls in ("a", "b"):
        for name, image in good.items():
            save(image, root / cls / name)
        (root / cls / "rotated.jpg").write_bytes(rotated_jpeg())
    whole = (root / "a" / "rgb.png").read_bytes()
    (root / "a" / "truncated.png").write_bytes(whole[: len(whole) // 2])  # caught when decoded
    noisy = save(Image.effect_noise((64, 64), 60).convert("RGB"), root / "a" / "noisy.jpg").read_bytes()
    (root / "a" / "truncated.jpg").write_bytes(noisy[: len(noisy) * 2 // 3])  # caught when decoded
    (root / "b" / "garbage.jpg").write_bytes(b"this is not a JPEG at all" * 10)
    (root / "b" / "empty.png").write_bytes(b"")
    (root / "b" / "notes.txt").write_text("not an image, and not named like one")
    return root


@pytest.mark.parametrize(
    ("image", "pixel"),
    [
        (Image.new("L", (4, 4), 77), (77, 77, 77)),
        (Image.new("RGBA", (4, 4), (255, 0, 0, 0)), (255, 255, 255)),  # transparent: white
        (Image.new("LA", (4, 4), (0, 255)), (0, 0, 0)),
        (Image.new("CMYK", (4, 4), (0, 0, 0, 0)), (255, 255, 255)),
        (Image.new("I;16", (4, 4), 60000), (234, 234, 234)),  # 16-bit scaled, not clipped
        (Image.fromarray(np.full((4, 4), 60000, dtype=">u2")), (234, 234, 234)),  # ImageJ's TIFFs
        (Image.new("I", (4, 4), 256 * 100), (100, 100, 100)),
        (Image.new("F", (4, 4), 0.5), (127, 127, 127)),  # float in [0, 1], not black
        (Image.new("F", (4, 4), 1.0), (255, 255, 255)),  # a white float image: in [0, 1] too
        (with_info(Image.new("L", (4, 4), 9), transparency=9), (255, 255, 255)),  # a PNG's tRNS
        (with_info(Image.new("RGB", (4, 4), (1, 2, 3)), transparency=(1, 2, 3)), (255, 255, 255)),
    ],
    ids=["L", "RGBA", "LA", "CMYK", "I;16", "I;16B", "I", "F", "F-white", "L-tRNS", "RGB-tRNS"],
)
def test_every_mode_becomes_8_bit_rgb(image, pixel):
    rgb = to_rgb(image)
    assert rgb.mode == "RGB" and rgb.getpixel((0, 0)) == pixel


@pytest.mark.parametrize(
    "values",
    [
        np.linspace(0, 1.9e9, 16, dtype=np.int32),  # 32-bit: was white from 1/3 of its range
        np.linspace(-1000, 1000, 16).astype(np.int32),  # signed 16-bit: was 0..3
        np.linspace(0, 1000, 16, dtype=np.float32),  # wide floats: was white past 255
        np.linspace(-1, 1, 16, dtype=np.float32),  # was black below 0
    ],
    ids=["I-32-bit", "I-signed", "F-wide", "F-signed"],
)
def test_wide_grey_values_past_16_bits_or_the_unit_range_keep_their_range(values):
    rgb = np.asarray(to_rgb(Image.fromarray(values.reshape(4, 4))))[..., 0].flatten()
    assert rgb[0] == 0 and rgb[-1] == 255 and (np.diff(rgb.astype(int)) > 0).all()


def test_floats_in_the_unit_range_stay_in_it_with_a_rounding_below_0_or_a_nan():
    """One pixel at -1e-6 (a resampling's rounding) stretched the image to its own range."""
    values = np.linspace(0, 0.8, 16, dtype=np.float32).reshape(4, 4)
    expected = np.asarray(to_rgb(Image.fromarray(values)))
    assert expected.max() == 204
    for odd in (-1e-6, np.nan):
        changed = values.copy()
        changed[0, 0] = odd
        assert np.array_equal(np.asarray(to_rgb(Image.fromarray(changed))), expected)
    flat = to_rgb(Image.fromarray(np.full((4, 4), 300.0, dtype=np.float32)))  # no range: mid-grey
    assert set(np.asarray(flat).flatten()) == {127}


def test_a_16_bit_pngs_transparent_grey_becomes_white_and_only_it():
    """Its tRNS value is a 16-bit grey: matched against the 8-bit values it whitened other
    pixels and left itself black."""
    grey = np.full((4, 4), 30000, np.uint16)
    grey[:2] = 117
    file = io.BytesIO()
    Image.fromarray(grey).save(file, "PNG", transparency=117)
    with Image.open(file) as image:
        assert image.mode.startswith("I") and image.info["transparency"] == 117
        rgb = to_rgb(image)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((0, 3)) == (117, 117, 117)


def test_palette_transparency_becomes_white():
    image = Image.new("P", (4, 4), 0)
    image.putpalette([10, 20, 30] * 256)
    image.info["transparency"] = 0
    assert to_rgb(image).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied_to_size_and_pixels():
    with Image.open(io.BytesIO(rotated_jpeg())) as image:
        assert upright_size(image) == (40, 20)
        sample = image_to_sample(image, 0, patch_size=4, max_patches=200)
    assert sample.grid == (10, 5)


@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("kind", ["JPEG", "PNG", "WEBP", "TIFF"])
def test_every_format_is_turned_upright_once_as_pillow_turns_it(kind, orientation):
    """Pillow turns TIFFs upright itself: they were turned twice (sides swapped, upside down).
    The training flip mirrors the upright image left to right, not the stored one."""
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 20, 10))  # the stored top-left quarter red
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, kind, exif=exif)
    with Image.open(buffer) as image:
        upright = ImageOps.exif_transpose(image)
    with Image.open(buffer) as image:
        assert upright_size(image) == (upright.height, upright.width)
        sample = image_to_sample(image, 0, patch_size=4, max_patches=200)
    assert sample.grid == (upright.height // 4, upright.width // 4)
    corner = sample.patches[0].reshape(16, 3).float().mean(0)  # the top-left patch's colour
    assert torch.allclose(corner, torch.tensor(upright.getpixel((1, 1)), dtype=torch.float32), atol=40)
    with Image.open(buffer) as image:
        mirrored = image_to_sample(image, 0, patch_size=4, max_patches=200, mirror=True)
    pixels = rearrange(mirrored.patches, "(h w) (p1 p2 c) -> (h p1) (w p2) c", w=mirrored.grid[1], p1=4, p2=4)
    assert torch.equal(pixels, torch.from_numpy(np.array(ImageOps.mirror(upright.convert("RGB")))))


def test_huge_and_tiny_images_fit_the_patch_budget():
    huge = image_to_sample(Image.new("RGB", (3000, 2000)), 0, patch_size=16, max_patches=64)
    tiny = image_to_sample(Image.new("RGB", (3, 2)), 0, patch_size=16, max_patches=64)
    assert 56 <= huge.grid[0] * huge.grid[1] <= 64 and huge.grid[1] > huge.grid[0]
    assert tiny.grid == (1, 1)


def test_unreadable_files_are_left_out_at_scan_and_truncated_ones_when_decoded(tmp_path, caplog):
    root = make_messy_folder(tmp_path / "images")
    images, unreadable, _ = split_images(index_folder(root), root, "", ["a", "b"])
    assert not any(path.endswith(".txt") for path in images.paths.tolist())
    with caplog.at_level(logging.WARNING):
        warn_unreadable(unreadable)
    assert len(unreadable) == 2
    for name in ("garbage.jpg", "empty.png"):
        assert caplog.text.count(f"{name}: not a readable image") == 1
    assert "truncated" not in caplog.text  # whole headers
    dataset = ImageFolder(images, patch_size=16)

    caplog.clear()
    columns = SizePolicy(patch_size=16, max_patches=64).keys(dataset.sizes, seed=0, epoch=0)
    keys = columns.take(np.arange(len(dataset)))
    with caplog.at_level(logging.WARNING):
        samples = [dataset[key] for key in keys]
        assert not caplog.text  # a loader worker's log would reach neither the console's format nor train.log
        dataset.name_new_failures()
        samples += [dataset[key] for key in keys]
        dataset.name_new_failures()
        assert dataset.take_unreadable_count() == 4
        assert dataset.take_unreadable_count() == 0  # taken
    names = [Path(dataset.images.name(index)).name for index in range(len(dataset))]
    failed = sorted(names[i % len(names)] for i, s in enumerate(samples) if s is None)
    assert failed == ["truncated.jpg"] * 2 + ["truncated.png"] * 2
    for name in ("truncated.jpg", "truncated.png"):  # named once, with what decoding says
        assert (
            len(re.findall(rf"skipping \S*{name}: it could not be decoded \(.*truncated", caplog.text)) == 1
        )

    batch = PackCollate(PackedShape(8, 64, 8), 16 * 16 * 3)(samples[: len(names)])
    assert batch.num_images == len(names) - 2


def test_every_loader_names_the_files_it_could_not_decode_whatever_the_callbacks(tmp_path, caplog):
    """callbacks=none (debug=fdr too) skipped them without a word once the report callback
    named them; eval.py at several patch budgets counted none."""
    datamodule = PackedImageDataModule(str(make_messy_folder(tmp_path / "images")), num_workers=0)
    datamodule.setup("fit")
    with caplog.at_level(logging.WARNING):
        for loader in (datamodule.train_dataloader(), datamodule.val_dataloader()):
            list(loader)
    named = re.findall(r"skipping \S*/(\S+): it could not be decoded", caplog.text)
    assert sorted(named) == ["truncated.jpg", "truncated.png"]
    report, counts = UnreadableImageReport(), {"test/unreadable_images/dataloader_idx_0": torch.tensor(2.0)}
    counts["test/decoded_images/dataloader_idx_0"] = torch.tensor(20.0)
    report.counted_epochs["test"] = 0
    counts["test/unreadable_images/dataloader_idx_1"] = torch.tensor(2.0)  # the same images at another budget
    with caplog.at_level(logging.WARNING):
        report.on_test_end(SimpleNamespace(callback_metrics=counts, is_global_zero=True), one_image_batches())
    assert "test: skipped 2 images that could not be decoded" in caplog.text  # a test is no epoch


def test_files_that_pillows_plugins_fail_on_otherwise_are_skipped_too(tmp_path):
    """Byte-flipped files (tests/data/corrupt) on which Pillow's AVIF plugin raises
    RuntimeError, at the header or the frame, and its TIFF plugin TypeError: they ended the
    scan, the run and predict.py."""
    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    for path in CORRUPT.iterdir():
        (root / "a" / path.name).write_bytes(path.read_bytes())
    save(Image.new("RGB", (40, 30), (9, 9, 9)), root / "a" / "good.png")
    images, unreadable, _ = split_images(index_folder(root), root, "", ["a"])
    assert [Path(path).name for path, _ in unreadable] == ["no_image_item.avif"]
    dataset = ImageFolder(images, patch_size=16)
    keys = SizePolicy(patch_size=16, max_patches=64).keys(dataset.sizes, seed=0, epoch=0)
    decoded = {
        Path(dataset.images.name(i)).name: dataset[key]
        for i, key in enumerate(keys.take(np.arange(len(dataset))))
    }
    assert {name for name, sample in decoded.items() if sample is None} == {
        "bad_frame.avif",
        "bad_rational.tif",
    }
    assert decoded["good.png"] is not None and dataset.take_unreadable_count() == 2


def test_images_past_data_max_image_pixels_are_left_out_by_name_and_pillows_guard_is_not_in_the_way(
    tmp_path, caplog, monkeypatch
):
    """Pillow refused images over 179 MP as "could be decompression bomb DOS attack", with no
    setting to read them, and warned of those over 89 MP naming no file, once per worker."""
    for name in ("a/1.png", "a/2.png", "b/1.png", "b/2.png"):
        save(Image.new("RGB", (16, 16)), tmp_path / "images" / name)
    save(Image.new("RGB", (100, 60)), tmp_path / "images" / "a" / "wide.png")
    kept = {}
    for limit in (5000, None):
        datamodule = PackedImageDataModule(
            str(tmp_path / "images"), patch_size=8, max_patches=16, num_workers=0, max_image_pixels=limit
        )
        datamodule.prepare_data()
        with caplog.at_level(logging.WARNING):
            datamodule.setup("fit")
            datamodule.predict_on(sorted((tmp_path / "images").rglob("*.png")))
            datamodule.setup("predict")
        kept[limit] = {name: len(dataset) for name, dataset in datamodule.datasets.items()}
    assert kept[5000]["predict"] == 4 and kept[None]["predict"] == 5
    assert kept[5000]["train"] + kept[5000]["val"] == 4 and kept[None]["train"] + kept[None]["val"] == 5
    wide = tmp_path / "images" / "a" / "wide.png"
    reason = (
        "100 x 60 = 6,000 pixels, over data.max_image_pixels=5,000: raise it, or set it to null, to read it"
    )
    assert caplog.text.count(f"skipping {wide}: not a readable image ({reason} (eval.py and predict.py") == 2
    save(Image.new("1", (20_000, 10_000)), tmp_path / "scan.png")  # 200 MP, 1 bit a pixel
    assert read_size(str(tmp_path / "scan.png")) == (10_000, 20_000)
    with pytest.raises(Image.DecompressionBombError):  # Pillow's guard lifted for the project alone
        Image.open(tmp_path / "scan.png").close()
    # another format under an image's name: some decode whole as they open (an ICO of a
    # 40000-pixel square PNG took 1.8 GB), within Pillow's guard (here 2 x 100 pixels)
    Image.new("RGB", (16, 16)).save(tmp_path / "icon.png", format="ICO")
    Image.new("RGB", (16, 16)).save(tmp_path / "small.png")
    assert read_size(str(tmp_path / "icon.png")) == (16, 16)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    assert "could be decompression bomb" in read_size(str(tmp_path / "icon.png"))
    assert read_size(str(tmp_path / "small.png")) == (16, 16)


def test_a_split_folder_of_empty_class_folders_says_it_holds_no_images(tmp_path):
    """It said "no readable images" of a folder with no file in it."""
    for split in ("train", "val"):
        for name in ("a/1.png", "b/1.png"):
            save(Image.new("RGB", (16, 16)), tmp_path / split / name)
    for name in ("a", "b"):
        (tmp_path / "test" / name).mkdir(parents=True)
    datamodule = PackedImageDataModule(str(tmp_path), patch_size=8, max_patches=4, num_workers=0)
    datamodule.prepare_data()
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(tmp_path / 'test'))} holds no images: put them in its"
    ):
        datamodule.setup("fit")


def test_pillows_guard_stays_lifted_while_any_thread_decodes_and_comes_back_after_the_last(tmp_path):
    """One thread leaving put it back under another's decode, which the other then lifted for
    good, for the whole process."""
    save(Image.new("RGB", (8, 8)), tmp_path / "a.png")
    guard = Image.MAX_IMAGE_PIXELS
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first() -> None:
        with opened(str(tmp_path / "a.png")):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with opened(str(tmp_path / "a.png")):
            second_in.set()
            first_out.wait(10)
            seen["inside"] = Image.MAX_IMAGE_PIXELS

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"inside": None} and guard == Image.MAX_IMAGE_PIXELS


def test_refused_roots_say_what_to_fix(tmp_path, monkeypatch):
    def refused(root, **kwargs):
        with pytest.raises(DataError) as error:
            PackedImageDataModule(str(root), **kwargs).class_names()
        return str(error.value)

    # eval.py, which takes the data group from the checkpoint, refuses data.root alone
    assert "does not exist: give data=imagefolder data.root=<the folder" in refused(tmp_path / "nowhere")
    (tmp_path / "images.zip").write_bytes(b"PK")  # said not to exist
    assert "is a file: unpack it, and give data=imagefolder data.root=" in refused(tmp_path / "images.zip")
    (tmp_path / "flat").mkdir()
    save(Image.new("RGB", (8, 8)), tmp_path / "flat" / "loose.png")
    assert "has no class sub-folders" in refused(tmp_path / "flat")
    (tmp_path / "flat" / "shard-000000.tar").write_bytes(b"")  # data=imagefolder on a shard folder
    assert "(its .tar files: shards of one? read them with data=shards)" in refused(tmp_path / "flat")
    save(Image.new("RGB", (8, 8)), tmp_path / "holey" / "cat" / "1.png")
    (tmp_path / "holey" / "dog").mkdir()
    assert "class folder" in refused(tmp_path / "holey") and "dog holds no images" in refused(
        tmp_path / "holey"
    )
    with monkeypatch.context() as unlisted:  # chmod 000 as another user than root: "holds no images"
        unlisted.setattr(folder.os, "access", lambda path, mode: Path(path).name != "dog")
        assert "dog cannot be listed (permission denied): give this user read access" in refused(
            tmp_path / "holey"
        )
    (tmp_path / "bare" / "cat").mkdir(parents=True)
    (tmp_path / "bare" / "cat" / "readme.md").write_text("no images here")
    for number in range(2):  # a phone's photos: said to hold nothing
        (tmp_path / "bare" / "cat" / f"IMG_{number}.HEIC").write_bytes(b"")
    assert "cat holds no images (.avif" in refused(tmp_path / "bare")
    assert "), 3 file(s) of other types left out (.heic 2, .md 1): add images" in refused(tmp_path / "bare")
    save(Image.new("RGB", (8, 8)), tmp_path / "alone" / "cat" / "1.png")
    assert "has one class folder (cat): a classifier needs two or more" in refused(tmp_path / "alone")
    with pytest.raises(DataError, match=r"lower data\.max_patches"):
        PackedImageDataModule(str(tmp_path), max_patches=300, row_len=256)


def test_the_class_check_and_the_manifest_take_the_same_files(tmp_path):
    """Both walk index.image_entries: a macOS zip's __MACOSX/ (only hidden ._ files) passed
    the check and became a class without images, shifting every label; a class of linked
    folders was refused though the manifest held their images; a link loop crashed."""
    root = tmp_path / "root"
    for name in ("cat", "dog"):
        save(Image.new("RGB", (8, 8)), root / name / "0.png")
    (root / "__MACOSX" / "cat").mkdir(parents=True)
    (root / "__MACOSX" / "cat" / "._0.png").write_bytes(b"\0\5\26\7 AppleDouble")
    with pytest.raises(DataError, match=r"__MACOSX holds no images"):
        PackedImageDataModule(str(root)).class_names()

    stored = tmp_path / "store"
    save(Image.new("RGB", (8, 8)), stored / "1.png")
    linked = tmp_path / "linked"
    save(Image.new("RGB", (8, 8)), linked / "cat" / "0.png")
    (linked / "dog").mkdir()
    (linked / "dog" / "batch1").symlink_to(stored, target_is_directory=True)
    (linked / "cat" / "up").symlink_to(linked, target_is_directory=True)  # a loop
    # the same folder by a second path, listed first or last: each path keeps its images
    # (the first listed took them, and a class could lose them to a link it is not in)
    (linked / "aaa").symlink_to(linked / "dog", target_is_directory=True)
    (linked / "zzz").symlink_to(stored, target_is_directory=True)
    manifest = index_folder(linked)
    assert sorted(manifest.paths.tolist()) == [
        "aaa/batch1/1.png",
        "cat/0.png",
        "dog/batch1/1.png",
        "zzz/1.png",
    ]
    for link in ("aaa", "zzz"):
        (linked / link).unlink()
    datamodule = PackedImageDataModule(str(linked), val_fraction=0.5, num_workers=0)
    assert datamodule.class_names() == ["cat", "dog"]
    manifest = index_folder(linked)
    assert sorted(manifest.paths.tolist()) == ["cat/0.png", "dog/batch1/1.png"]


def test_classes_whose_every_image_is_held_out_and_images_in_no_class_are_named(tmp_path):
    """A class of one image, drawn into val, was never trained on, without a word."""
    for number in range(8):
        save(Image.new("RGB", (8, 8), (number, 0, 0)), tmp_path / f"class{number}" / "only.png")
    datamodule = PackedImageDataModule(str(tmp_path), val_fraction=0.2, split_by_path=True, num_workers=0)
    save(Image.new("RGB", (8, 8)), tmp_path / "stray.png")  # in no class: named, not silently lost
    with pytest.warns(UserWarning, match="data.val_fraction=0.2 held out every image of") as warned:
        datamodule.setup("fit")
    beside = f"{tmp_path}: left out 1 image(s) beside its class folders (stray.png): an image's class"
    assert any(beside in str(warning.message) for warning in warned)
    held = sorted(datamodule.class_names()[label] for label in datamodule.datasets["val"].images.labels)
    named = f"of {', '.join(held)}: the model never trains on them"
    assert held and any(named in str(warning.message) for warning in warned)


def test_classes_that_an_evaluation_split_holds_no_image_of_are_named(tmp_path):
    """val/acc, the best checkpoint it picks and the test's accuracy were over the other
    classes alone; only the counts' line, of ten classes at most, showed it."""
    for name in ("train/cat", "train/dog", "train/owl", "val/cat", "test/cat", "test/dog", "test/owl"):
        save(Image.new("RGB", (8, 8)), tmp_path / name / "0.png")
    with pytest.warns(UserWarning) as warned:
        PackedImageDataModule(str(tmp_path), num_workers=0).setup("fit")
    lines = [str(warning.message) for warning in warned if "holds no image of" in str(warning.message)]
    assert lines == ["the val split holds no image of dog, owl: val/acc says nothing of them"]


def test_a_val_class_that_train_has_not_is_refused(tmp_path):
    """Its images were left out of val without a word."""
    for split, names in (("train", ("cat", "dog")), ("val", ("cat", "dog", "bird"))):
        for name in names:
            save(Image.new("RGB", (8, 8)), tmp_path / split / name / "0.png")
    with pytest.raises(DataError, match=r"val has class folders that .*train has not \(bird\)"):
        PackedImageDataModule(str(tmp_path), num_workers=0).setup("fit")


def test_split_folders_are_found_by_their_names_in_any_case_and_a_class_may_be_called_train(tmp_path):
    """Train/ Val/ became a 2-class model of the split names; a Roboflow export's valid/ was
    left out without a word (val held out of train); a test/ beside a flat root's classes
    became a class; a flat root's class named train (CIFAR-100 has one) was refused."""

    def layout(root: Path) -> dict[str, list[str]]:
        datamodule = PackedImageDataModule(str(root), val_fraction=0.5, num_workers=0)
        datamodule.setup("fit")
        assert datamodule.class_names() == ["cat", "dog"] or datamodule.class_names() == ["bus", "train"]
        return {name: sorted(dataset.images.paths.tolist()) for name, dataset in datamodule.datasets.items()}

    for split in ("Train", "valid", "test", "extra"):
        for name in ("cat", "dog"):
            save(Image.new("RGB", (8, 8)), tmp_path / "export" / split / name / "0.png")
    save(Image.new("RGB", (8, 8)), tmp_path / "export" / "stray.png")  # in no split, and in no class
    unused = f"{tmp_path / 'export'}: left out extra/, stray.png (the splits are Train/, valid/, test/)"
    with pytest.warns(UserWarning, match=re.escape(unused)):
        splits = layout(tmp_path / "export")
    assert splits == {
        "train": ["Train/cat/0.png", "Train/dog/0.png"],
        "val": ["valid/cat/0.png", "valid/dog/0.png"],
        "test": ["test/cat/0.png", "test/dog/0.png"],
    }

    for number in range(2):
        for name in ("bus", "train"):  # a class of images, not a split of class folders
            save(Image.new("RGB", (8, 8)), tmp_path / "vehicles" / name / f"{number}.png")
    assert {path.split("/")[0] for path in layout(tmp_path / "vehicles")["train"]} <= {"bus", "train"}

    for name in ("invalid/a", "valid/2023", "valid/2024"):  # classes whose images lie in folders
        save(Image.new("RGB", (8, 8)), tmp_path / "nested" / name / "0.png")
    assert PackedImageDataModule(str(tmp_path / "nested")).class_names() == ["invalid", "valid"]

    for name in ("cat", "dog", "valid/2023", "test/cat", "test/dog"):  # test/ of the classes beside it
        save(Image.new("RGB", (8, 8)), tmp_path / "flat" / name / "0.png")
    for name in ("val/cat", "val/dog", "test/cat", "test/dog"):  # a split of val/ and test/ alone
        save(Image.new("RGB", (8, 8)), tmp_path / "no-train" / name / "0.png")
    for root in ("flat", "no-train"):
        with pytest.raises(
            DataError, match=r"/ but no train/ folder: put the training images in .*/train/<class>/"
        ):
            PackedImageDataModule(str(tmp_path / root)).class_names()
    evaluated = PackedImageDataModule(str(tmp_path / "no-train"), evaluate_all=True)
    assert evaluated.class_names() == ["cat", "dog"]
    for name in ("Training/apple", "Training/pear", "Test/apple", "Test/pear"):  # Fruits-360
        save(Image.new("RGB", (8, 8)), tmp_path / "fruits" / name / "0.png")
    assert PackedImageDataModule(str(tmp_path / "fruits")).class_names() == ["apple", "pear"]
    save(Image.new("RGB", (8, 8)), tmp_path / "export" / "val" / "cat" / "0.png")
    with pytest.raises(DataError, match=r"has 2 val folders \(val, valid\): keep one"):
        PackedImageDataModule(str(tmp_path / "export")).class_names()


@pytest.mark.parametrize(
    ("files", "refusal"),
    [
        (  # Dogs vs Cats: the labels in the names, an unlabelled test/
            ["train/cat.0.png", "train/dog.0.png", "test/0.png"],
            "test/, train/ hold images, not class folders: put the training images in",
        ),
        (  # the classes' own folders beside it: val/ is a class
            ["train/0.png", "val/cat/0.png", "val/dog/0.png"],
            "train/, val/ hold images, not class folders: put the training images in",
        ),
        (
            ["cat/train/0.png", "cat/val/1.png", "dog/train/0.png", "dog/val/1.png"],
            "its class folders hold train/, val/: put the splits above the classes",
        ),
    ],
    ids=["splits-of-images", "splits-of-images-beside-classes", "splits-in-classes"],
)
def test_split_folders_where_the_classes_were_looked_for_are_refused(tmp_path, files, refusal):
    """Trained as they were: a model of the split names (its test accuracy 0 on val images
    of "train"), or a class's own val/ images trained on, val drawn from its train/."""
    for name in files:
        save(Image.new("RGB", (8, 8)), tmp_path / name)
    with pytest.raises(DataError, match=re.escape(f"image folder {tmp_path}: {refusal}")):
        PackedImageDataModule(str(tmp_path), num_workers=0).class_names()


def test_class_folders_with_an_empty_split_named_folder_are_classes(tmp_path):
    for name in ("cat/0.png", "dog/0.png"):
        save(Image.new("RGB", (8, 8)), tmp_path / name)
        (tmp_path / name).parent.joinpath("test").mkdir()
    assert PackedImageDataModule(str(tmp_path), num_workers=0).class_names() == ["cat", "dog"]


def test_an_index_folder_inside_the_image_folder_is_refused(tmp_path):
    """The manifest written there became a class folder without images: the run refused
    itself, and so did every later one."""
    for name in ("cat", "dog"):
        save(Image.new("RGB", (8, 8)), tmp_path / name / "0.png")
    with pytest.raises(
        DataError, match=r"index folder .*/index is inside the image folder .*: put data.index_dir"
    ):
        PackedImageDataModule(str(tmp_path), index_dir=str(tmp_path / "index"), num_workers=0).setup("fit")
    # a hidden one is no class folder
    PackedImageDataModule(str(tmp_path), index_dir=str(tmp_path / ".index"), num_workers=0).setup("fit")


def test_a_class_of_only_unreadable_files_is_refused_at_setup(tmp_path):
    """It trained with no image of the class, named only in per-file warnings."""
    save(Image.new("RGB", (8, 8)), tmp_path / "cat" / "0.png")
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "broken.png").write_bytes(b"\x89PNG but not really")
    with pytest.raises(DataError, match=r"class folder .*dog holds no readable image \(named above\)"):
        PackedImageDataModule(str(tmp_path), val_fraction=0.5).setup("fit")


@pytest.mark.slow
def test_train_on_a_messy_folder_to_the_end_and_evaluate_it_from_elsewhere(run_entry_point, tmp_path):
    make_messy_folder(tmp_path / "messy")
    result = run_entry_point(
        "train.py",
        *TINY_TRAINING,
        "data=imagefolder",
        "data.root=messy",  # from the folder the command runs in
        "data.val_fraction=0.25",
        "data.max_patches=64",
        "data.row_len=64",
        "trainer.max_epochs=2",
        "data.num_workers=1",
    )
    output = result.stdout + result.stderr
    for name in ("garbage.jpg", "empty.png"):
        assert output.count(f"{name}: not a readable image") == 1
    # Decoded every epoch (2 here), named once, counted in each epoch's report; on the console
    # and in train.log both, though a loader worker decodes them; the warnings too.
    log = (run_folder(tmp_path) / "train.log").read_text()
    for text in (output, log):
        assert re.search(r"messy: left out 2 unreadable files \(named above\)", text)
    for name in ("truncated.jpg", "truncated.png"):
        assert (
            output.count(f"{name}: it could not be decoded")
            == log.count(f"{name}: it could not be decoded")
            == 1
        )
    skipped = re.findall(r"(?:train|val) epoch (\d): skipped (\d) images? that could not be decoded", output)
    assert {epoch: sum(int(n) for e, n in skipped if e == epoch) for epoch, _ in skipped} == {"0": 2, "1": 2}
    assert (
        re.findall(r"(?:train|val) epoch (\d): skipped (\d) images? that could not be decoded", log)
        == skipped
    )

    # The checkpoint holds the folder's absolute path: eval.py run elsewhere scores the images
    # the run held out, whatever hold-out the command gives, and the network's patch size only.
    checkpoint = f"ckpt_path={run_folder(tmp_path)}/checkpoints/last.ckpt"
    (tmp_path / "elsewhere").mkdir()
    scores = []
    for hold_out in ([], ["+data.split_seed=1"]):
        result = run_entry_point("eval.py", checkpoint, *hold_out, cwd=tmp_path / "elsewhere")
        output = result.stdout + result.stderr
        scores.append(re.search(r"test accuracy: [0-9.]+ on \d+ images", output)[0])
    assert scores[0] == scores[1] and "data.split_seed=1 left aside: the checkpoint's run held out" in output
    result = run_entry_point("eval.py", checkpoint, "+data.patch_size=16", check=False)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, errors
    assert "data.patch_size=16 given: the checkpoint's network takes patches of 8 px" in errors[0]


@pytest.mark.slow
def test_a_refused_root_exits_with_one_line(run_entry_point, tmp_path):
    (tmp_path / "empty_root").mkdir()
    result = run_entry_point(
        "train.py", "data=imagefolder", f"data.root={tmp_path / 'empty_root'}", check=False
    )
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and "has no class sub-folders" in errors[0]
    assert "Traceback" not in result.stderr


def test_hidden_folders_beside_the_classes_are_no_classes(tmp_path):
    """Jupyter leaves .ipynb_checkpoints/ in every folder it opens, and a file manager its
    .thumbnails/ of images: taken for classes, they had the root refused (a class folder
    without images) or trained a class of thumbnails, shifting every label. A Synology NAS
    keeps @eaDir/ beside the images, thumbnails of each: they were trained on, the data
    doubled, an image in val while its thumbnail trained."""
    for name in ("cat/0.png", "dog/0.png", ".thumbnails/0.png", "cat/@eaDir/0.png/SYNOPHOTO_THUMB_S.jpg"):
        save(Image.new("RGB", (8, 8)), tmp_path / name)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "@eaDir").mkdir()
    datamodule = PackedImageDataModule(str(tmp_path), num_workers=0)
    assert datamodule.class_names() == ["cat", "dog"]
    datamodule.setup("fit")
    assert len(datamodule.datasets["train"]) + len(datamodule.datasets["val"]) == 2


def test_unreadable_images_are_warned_once_per_counted_epoch_at_its_number_and_never_from_the_sanity_check(
    caplog,
):
    """The sanity check's count is no epoch's (it was warned beside the first validation's),
    a hook with no batch counted since the last warning warns nothing, and a count of 0 is
    not worth a line."""
    logged = []
    module = one_image_batches(log=lambda name, value, **options: logged.append((name, float(value))))
    dataset = SimpleNamespace(
        take_unreadable_count=lambda: 1,
        failed=lambda: np.array([True, False]),  # of a class's two images: it goes on
        images=SimpleNamespace(labels=np.array([0, 0])),
    )
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=lambda tensor, reduce_op: tensor),
        datamodule=SimpleNamespace(datasets={"train": dataset, "val": dataset}),
        loggers=[],
        current_epoch=3,
        sanity_checking=True,
        is_global_zero=True,
        callback_metrics={
            "val/unreadable_images": torch.tensor(1.0),
            "val/decoded_images": torch.tensor(5.0),
            "train/unreadable_images": torch.tensor(0.0),
        },
    )
    report = UnreadableImageReport()
    with caplog.at_level(logging.WARNING):
        report.on_validation_batch_end(trainer, module)
        report.on_validation_end(trainer, module)
        trainer.sanity_checking = False
        report.on_validation_batch_end(trainer, module)
        report.on_validation_end(trainer, module)
        report.on_validation_end(trainer, module)
        report.on_train_batch_end(trainer, module)
        report.on_train_end(trainer, module)
    assert [(name, value) for name, value in logged if "unreadable" in name] == [
        ("val/unreadable_images", 1.0)
    ] * 2 + [("train/unreadable_images", 1.0)]
    assert [name for name, _ in logged if "decoded" in name] == ["val/decoded_images"] * 2 + [
        "train/decoded_images"
    ]
    warned = re.findall(r"\w+ epoch \d+: skipped .*", caplog.text)
    assert warned == ["val epoch 3: skipped 1 image that could not be decoded"]


def one_image_batches(**module) -> SimpleNamespace:
    """A LightningModule's stand-in whose every batch holds one decoded image."""
    return SimpleNamespace(batch_counts=SimpleNamespace(images=1), device=torch.device("cpu"), **module)


def test_a_stage_that_decoded_no_image_stops_the_run_and_one_that_decoded_some_goes_on():
    """The data folder unmounted mid-run: every image failed, and the run trained on nothing
    and logged val/acc 0.0 to the end (a sweep's trial scored 0.0). Decided from the epoch's
    counts that Lightning reduced over the ranks, equal on every rank; of an evaluation at
    several patch budgets, one loader decoding is enough."""
    failing = SimpleNamespace(take_unreadable_count=lambda: 2)
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(datasets={"train": failing, "val": failing}, root=Path("/mnt/gone")),
        loggers=[],
        current_epoch=4,
        sanity_checking=False,
        is_global_zero=True,
        callback_metrics={
            "val/unreadable_images": torch.tensor(2.0),
            "val/decoded_images": torch.tensor(1.0),
        },
    )
    module = one_image_batches(log=lambda *_, **__: None)
    report = UnreadableImageReport()
    report.on_validation_batch_end(trainer, module)
    report.on_validation_end(trainer, module)  # one decoded: goes on
    trainer.callback_metrics = {
        "train/unreadable_images": torch.tensor(3.0),
        "train/decoded_images": torch.tensor(0.0),
        "val/unreadable_images/dataloader_idx_0": torch.tensor(2.0),
        "val/decoded_images/dataloader_idx_0": torch.tensor(0.0),
        "val/unreadable_images/dataloader_idx_1": torch.tensor(2.0),
        "val/decoded_images/dataloader_idx_1": torch.tensor(1.0),
    }
    report.on_validation_batch_end(trainer, module)
    report.on_validation_end(trainer, module)
    report.on_train_batch_end(trainer, module)
    with pytest.raises(
        DataError, match=r"^train epoch 4: none of its 3 images could be decoded .* under /mnt/gone"
    ):
        report.on_train_epoch_start(trainer, module)
    report.on_validation_batch_end(trainer, module)
    del trainer.callback_metrics["val/decoded_images/dataloader_idx_1"]
    with pytest.raises(DataError, match=r"^val epoch 4: none of its 2 images"):
        report.on_validation_end(trainer, module)


def failing_class_trainer(failed: dict[str, list[int]]) -> SimpleNamespace:
    """A trainer's stand-in after a training epoch that skipped images: two classes of two
    training and two validation images each, `failed` of them (by index) in this process."""

    def split(indices):
        return SimpleNamespace(
            images=SimpleNamespace(labels=np.array([0, 0, 1, 1])),
            failed=lambda: np.isin(np.arange(4), indices),
        )

    return SimpleNamespace(
        datamodule=SimpleNamespace(
            datasets={name: split(indices) for name, indices in failed.items()},
            class_names=lambda: ["a", "b"],
        ),
        # DDPStrategy.reduce's: an all_reduce where a process group is up
        strategy=SimpleNamespace(
            root_device=torch.device("cpu"),
            reduce=lambda tensor, reduce_op: _sync_ddp_if_available(tensor, reduce_op=reduce_op),
        ),
        callback_metrics={"train/unreadable_images": torch.tensor(1.0)},
    )


def refused_class(rank: int, failed_on_ranks: list[dict[str, list[int]]]) -> str | None:
    try:
        UnreadableImageReport()._check_classes_never_decoded(failing_class_trainer(failed_on_ranks[rank]))
    except DataError as error:
        return str(error)
    return None


def test_a_class_whose_every_image_fails_to_decode_on_whichever_rank_stops_the_run():
    """Its images were named and counted each epoch, and the run trained around the class (a
    val class is warned of, as one without images in the val split is). Each rank fails the
    images it is dealt: their union decides, on both."""
    assert refused_class(0, [{"train": [0, 2], "val": [1]}]) is None
    report, trainer = UnreadableImageReport(), failing_class_trainer({"train": [1], "val": [2, 3]})
    with pytest.warns(
        UserWarning, match=r"^val: every image of class b \(2\) failed to decode .* says nothing"
    ):
        report._check_classes_never_decoded(trainer)
    report._check_classes_never_decoded(trainer)  # once: the warning is not repeated every epoch
    dealt = [{"train": [0], "val": []}, {"train": [1], "val": [3]}]
    assert [refused_class(rank, dealt) for rank in (0, 1)] == [None, None]  # each rank's alone
    said = refused_class(0, [{"train": [0, 1], "val": []}])
    assert said.startswith(
        "train: every image of class a (2) failed to decode (named above), and the run trained"
    )
    assert on_two_gloo_ranks(refused_class, dealt) == {0: said, 1: said}


@pytest.mark.slow
def test_a_ddp_run_whose_training_images_of_a_class_all_fail_to_decode_stops_on_every_rank_with_one_line(
    run_entry_point, tmp_path
):
    """Counted on each rank, reduced by Lightning's logging, decided on every rank alike: a
    collective of the callback's own in an epoch-end hook met the progress bar's metric sync
    on rank 0 and hung (see the note in utils/callbacks.py). The class's failures are joined
    over the ranks at the next epoch's start; the stage decoded class b's images: no stop
    for a stage that decoded none (a test above)."""
    noise = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    for split, count in (("train", 12), ("val", 4)):
        for cls in ("a", "b"):
            for index in range(count):
                path = save(Image.fromarray(noise), tmp_path / "images" / split / cls / f"{index}.png")
                if split == "train" and cls == "a":
                    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result = run_entry_point(
        "train.py",
        *TINY_TRAINING,
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "trainer.max_epochs=2",
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.strategy.collective_timeout_s=60",  # a hang ends in a line, in a minute
        check=False,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = set(re.findall(r"error: (.*)", output))  # the same line from each rank
    assert len(errors) == 1 and errors.pop().startswith(
        "train: every image of class a (12) failed to decode (named above), and the run trained around "
        "it: restore them and resume (ckpt_path=last hydra.run.dir="
    )
    assert "train epoch 0: skipped 12 images that could not be decoded" in output
    assert "Traceback" not in output
