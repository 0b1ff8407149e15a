"""Shards of an image folder: readable by any tar reader, and the same batches as the folder."""

import json
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.shards import write_shards
from navit_lightning.errors import DataError
from tests.conftest import TINY_SET, TINY_TRAINING


def datamodule(root, **kwargs):
    module = PackedImageDataModule(
        str(root), patch_size=16, max_patches=36, rows=4, row_len=64, num_workers=0, **kwargs
    )
    module.setup("fit")
    return module


@pytest.fixture()
def folder_with_a_broken_sample(project_root, tmp_path):
    """The tiny shapes set, a file that is no image, and a JPEG cut short after its header."""
    root = tmp_path / "images"
    shutil.copytree(project_root / TINY_SET, root, ignore=shutil.ignore_patterns(".*"))
    (root / "train" / "circle" / "garbage.jpg").write_bytes(b"no image")
    whole = next((root / "train" / "star").glob("*.jpg")).read_bytes()
    (root / "train" / "star" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    return root


def test_shards_hold_every_readable_image_as_webdataset_samples(folder_with_a_broken_sample, tmp_path):
    shards = tmp_path / "shards"
    manifest = write_shards(folder_with_a_broken_sample, shards, samples_per_shard=100)
    assert "train/circle/garbage.jpg" not in manifest.paths.tolist()  # left out, named
    index = json.loads((shards / "train.wids.json").read_text())
    assert [shard["nsamples"] for shard in index["shardlist"]] == [100, 93]  # 192 + cut.jpg
    with tarfile.open(shards / index["shardlist"][0]["url"]) as tar:
        names = tar.getnames()[:3]
        sample = json.loads(tar.extractfile(names[2]).read())
        label = int(tar.extractfile(names[1]).read())
    assert [name.split(".", 1)[1] for name in names] in (["jpg", "cls", "json"], ["png", "cls", "json"])
    # a sample's key (its members' stem) is unique across every shard, as webdataset reads them
    keys = []
    for shard in sorted(shards.glob("*.tar")):
        with tarfile.open(shard) as tar:
            keys += [name.split(".", 1)[0] for name in tar.getnames()]
    assert len(set(keys)) == len(keys) // 3 == len(manifest.paths)
    assert sample["path"].startswith("train/") and label == sorted(
        p.name for p in (folder_with_a_broken_sample / "train").iterdir()
    ).index(sample["path"].split("/")[1])


def test_shards_give_the_folders_batches_and_skip_a_broken_sample(
    folder_with_a_broken_sample, tmp_path, caplog
):
    write_shards(folder_with_a_broken_sample, tmp_path / "shards", samples_per_shard=50)
    from_folder = datamodule(folder_with_a_broken_sample)
    from_shards = datamodule(tmp_path / "shards", shards=True)
    assert from_shards.class_names() == from_folder.class_names()
    for split in ("train", "val", "test"):
        assert len(from_shards.datasets[split]) == len(from_folder.datasets[split])
    for folder_batch, shard_batch in zip(
        from_folder.train_dataloader(), from_shards.train_dataloader(), strict=True
    ):
        assert torch.equal(folder_batch.patches, shard_batch.patches)
        assert torch.equal(folder_batch.labels, shard_batch.labels)
    assert from_shards.datasets["train"].take_unreadable_count() == 1
    assert "cut.jpg: it could not be decoded" in caplog.text  # named by its loader


def test_a_read_only_folder_is_sharded_with_its_manifest_in_index_dir(project_root, tmp_path, monkeypatch):
    """The command could not shard a read-only folder: its manifest had nowhere to go."""
    from navit_lightning.data import index

    monkeypatch.setattr(index.os, "access", lambda path, mode: False)  # as a read-only mount says
    root = project_root / TINY_SET
    write_shards(root, tmp_path / "shards", index_dir=tmp_path / "cache")
    assert any((tmp_path / "cache").iterdir()) and list((tmp_path / "shards").glob("val-*.tar"))


def test_a_folder_without_shards_is_refused_with_the_command_that_writes_them(tmp_path):
    with pytest.raises(DataError, match=r"python -m navit_lightning\.data\.shards"):
        PackedImageDataModule(str(tmp_path), shards=True).class_names()


def test_a_rewrite_cut_short_leaves_no_shard_folder_to_read(project_root, tmp_path, monkeypatch):
    """The old manifest's spans were read in the new tars: other images, under old labels."""
    write_shards(project_root / TINY_SET, tmp_path / "shards", samples_per_shard=64)

    def cut_short(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("navit_lightning.data.shards._add", cut_short)
    with pytest.raises(KeyboardInterrupt):
        write_shards(project_root / TINY_SET, tmp_path / "shards", samples_per_shard=64)
    with pytest.raises(DataError):
        PackedImageDataModule(str(tmp_path / "shards"), shards=True).class_names()


def test_a_folder_that_cannot_train_is_not_sharded(tmp_path):
    """It was written, and training failed mid-fit (one class) or refused it later."""
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    for name, content in (("cat/0.png", None), ("dog/0.png", b"not a png")):
        (tmp_path / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "x.png", tmp_path / "images" / name)
        if content:
            (tmp_path / "images" / name).write_bytes(content)
    with pytest.raises(DataError, match=r"dog holds no readable image"):
        write_shards(tmp_path / "images", tmp_path / "shards")
    shutil.rmtree(tmp_path / "images" / "dog")
    with pytest.raises(DataError, match=r"has one class folder \(cat\)"):
        write_shards(tmp_path / "images", tmp_path / "shards")
    # shards written into the folder became a class folder of no images: it trained no more
    with pytest.raises(
        DataError, match=r"images/shards is inside the image folder .*images: write the shards"
    ):
        write_shards(tmp_path / "images", tmp_path / "images" / "shards")
    assert not (tmp_path / "images" / "shards").exists()
    # into another image folder: the shards and their manifest lay among its class folders
    (tmp_path / "other" / "bird").mkdir(parents=True)
    with pytest.raises(DataError, match=r"other holds other files than a shard set \(bird\): write the"):
        write_shards(tmp_path / "images", tmp_path / "other")
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["bird"]


@pytest.mark.slow
def test_train_from_shards_to_the_end(project_root, run_entry_point, tmp_path):
    shards = tmp_path / "shards"
    written = subprocess.run(
        [
            sys.executable,
            "-m",
            "navit_lightning.data.shards",
            str(project_root / TINY_SET),
            str(shards),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stderr
    result = run_entry_point("train.py", *TINY_TRAINING, "data=shards", f"data.root={shards}")
    assert "test/acc" in result.stdout + result.stderr


def test_every_split_read_from_shards_is_the_folders_image_for_image(folder_with_a_broken_sample, tmp_path):
    """val's and test's images lie in later shards than train's: a split that kept the spans
    of the whole shard folder read other images under their labels, and the model was scored
    on the wrong pictures without a word."""
    write_shards(folder_with_a_broken_sample, tmp_path / "shards", samples_per_shard=50)
    from_folder = datamodule(folder_with_a_broken_sample)
    from_shards = datamodule(tmp_path / "shards", shards=True)
    for split in ("train", "val", "test"):
        folder_images = from_folder.datasets[split].images
        shard_images = from_shards.datasets[split].images
        assert shard_images.paths.tolist() == folder_images.paths.tolist()
        assert np.array_equal(shard_images.labels, folder_images.labels)
        for number in range(len(folder_images.labels)):
            with folder_images.open(number) as file, shard_images.open(number) as shard:
                assert shard.read() == file.read(), folder_images.paths[number]


def test_shards_are_numbered_in_turn_and_their_images_typed_in_lower_case(tmp_path):
    """webdataset reads shards by a brace range (train-{000000..000003}.tar) and a sample's
    image by its type as a key (.to_tuple("jpg", "cls")): a camera's 0.JPG sharded as
    000000000.JPG had no "jpg", and shards numbered by their first image broke the range."""
    for number in range(5):
        for name, suffix, kind in (("cat", "JPG", "JPEG"), ("dog", "PNG", "PNG")):
            (tmp_path / "images" / name).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8 + number)).save(tmp_path / "images" / name / f"{number}.{suffix}", kind)
    write_shards(tmp_path / "images", tmp_path / "shards", samples_per_shard=3)
    shards = sorted(path.name for path in (tmp_path / "shards").glob("*.tar"))
    assert shards == [f"train-{number:06d}.tar" for number in range(4)]  # 10 images, 3 a shard
    index = json.loads((tmp_path / "shards" / "train.wids.json").read_text())
    assert [shard["url"] for shard in index["shardlist"]] == shards
    types = []
    for shard in shards:
        with tarfile.open(tmp_path / "shards" / shard) as tar:
            types += [name.split(".", 1)[1] for name in tar.getnames()]
    assert sorted(set(types)) == ["cls", "jpg", "json", "png"]
    # written again, of fewer images: the earlier set's other shards were left beside them
    shutil.rmtree(tmp_path / "images" / "dog")
    (tmp_path / "images" / "bird").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "bird" / "0.png")
    write_shards(tmp_path / "images", tmp_path / "shards", samples_per_shard=3)
    assert sorted(path.name for path in (tmp_path / "shards").iterdir()) == [
        ".navit_manifest.npz",
        "classes.json",
        "train-000000.tar",
        "train-000001.tar",
        "train.wids.json",
    ]


def test_shards_of_a_folder_with_a_class_named_train_hold_its_classes(tmp_path):
    """CIFAR-100 has a class "train": a shard folder finds its splits from the paths its
    images had, where train/0.png (an image in train/) was taken for a train/ split of class
    folders, though the folder itself trains on train/ as a class."""
    for number in range(2):
        for name in ("bus", "train"):
            (tmp_path / "images" / name).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8 + number)).save(tmp_path / "images" / name / f"{number}.png")
    write_shards(tmp_path / "images", tmp_path / "shards")
    from_folder = datamodule(tmp_path / "images", val_fraction=0.5)
    from_shards = datamodule(tmp_path / "shards", shards=True, val_fraction=0.5)
    assert from_shards.class_names() == from_folder.class_names() == ["bus", "train"]
    for split in ("train", "val"):
        folder_images = from_folder.datasets[split].images
        shard_images = from_shards.datasets[split].images
        assert shard_images.paths.tolist() == folder_images.paths.tolist()
        assert np.array_equal(shard_images.labels, folder_images.labels)


def test_what_the_shards_leave_out_of_a_folder_is_named_as_training_from_it_names_it(tmp_path, caplog):
    """Images beside the class folders and folders beside the split folders: training from
    the folder warns of them, and writing its shards left them out without a word."""
    for split in ("train", "val", "extra"):
        for name in ("cat", "dog"):
            (tmp_path / "images" / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / "images" / split / name / "0.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "train" / "stray.png")
    with caplog.at_level("WARNING"):
        write_shards(tmp_path / "images", tmp_path / "shards")
    with pytest.warns(UserWarning) as warned:
        datamodule(tmp_path / "images")
    named = [str(warning.message) for warning in warned if "left out" in str(warning.message)]
    logged = [record.getMessage() for record in caplog.records if "left out" in record.getMessage()]
    assert len(named) == 2 and logged == named
