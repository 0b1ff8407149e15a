"""Shards of an image folder: readable by any tar reader, and the same batches as the folder."""

import json
import shutil
import subprocess
import sys
import tarfile

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
