"""The size manifest: built once, then no image file is opened to plan an epoch, and only
what changed in the folder is read again."""

import logging
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from navit_lightning.data import index
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.index import Manifest, StringTable, index_folder, manifest_path
from navit_lightning.errors import DataError

OPENED: list[str] | None = None


def _record_open(event: str, args: tuple) -> None:
    if event != "open" or OPENED is None or not isinstance(args[0], str | os.PathLike):
        return
    path = os.fspath(args[0])
    if os.path.splitext(path)[1] in index.IMAGE_SUFFIXES:
        OPENED.append(os.path.basename(path))


sys.addaudithook(_record_open)  # audit hooks cannot be removed: this one records only when asked


@contextmanager
def image_files_opened():
    global OPENED
    OPENED = []
    try:
        yield OPENED
    finally:
        OPENED = None


def make_folder(root, count=6):
    for number in range(count):
        folder = root / ("cats" if number % 2 else "dogs")
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (20 + number, 10 + 2 * number)).save(folder / f"{number}.png")
    (root / "dogs" / "broken.jpg").write_bytes(b"not a jpeg")
    return root


def test_a_second_index_opens_no_readable_image_and_a_changed_folder_reads_only_what_changed(
    tmp_path, caplog, monkeypatch
):
    root = make_folder(tmp_path / "images")
    with image_files_opened() as opened:
        first = index_folder(root)
    assert sorted(opened) == sorted(["broken.jpg", *(f"{n}.png" for n in range(6))])
    assert first.paths.tolist() == sorted(first.paths.tolist()) and len(first.paths) == 7
    assert first.reasons[first.paths.tolist().index("dogs/broken.jpg")]
    assert dict(zip(first.paths.tolist(), first.sizes.tolist(), strict=True))["cats/5.png"] == [20, 25]

    saved = manifest_path(root).stat().st_mtime_ns
    with image_files_opened() as opened:
        again = index_folder(root)
    # the unreadable file is tried again (a chmod, a mended mount or a newer Pillow may let it
    # in; it stayed left out); nothing changed, nothing saved
    assert opened == ["broken.jpg"] and again.paths == first.paths
    assert np.array_equal(again.sizes, first.sizes) and manifest_path(root).stat().st_mtime_ns == saved

    Image.new("RGB", (99, 7)).save(root / "cats" / "new.png")  # added
    (root / "dogs" / "0.png").unlink()  # removed
    Image.new("RGB", (8, 77)).save(root / "cats" / "1.png")  # replaced under the same name
    touched = (root / "cats" / "3.png").stat()  # rewritten in place at the same length
    os.utime(root / "cats" / "3.png", ns=(touched.st_atime_ns, touched.st_mtime_ns + 10**9))
    with image_files_opened() as opened, caplog.at_level(logging.INFO):
        changed = index_folder(root)
    assert sorted(opened) == ["1.png", "3.png", "broken.jpg", "new.png"]
    assert "4 read (new, changed or unreadable), 1 gone," in caplog.text  # the replaced one is not gone
    sizes = dict(zip(changed.paths.tolist(), changed.sizes.tolist(), strict=True))
    assert sizes["cats/new.png"] == [7, 99] and sizes["cats/1.png"] == [77, 8] and "dogs/0.png" not in sizes
    assert Manifest.load(manifest_path(root)).paths == changed.paths  # saved

    # a manifest cut short (a copy that stopped) is indexed again, not a crash
    manifest_path(root).write_bytes(manifest_path(root).read_bytes()[:100])
    with image_files_opened() as opened:
        again = index_folder(root)
    assert len(opened) == len(changed.paths) and again.paths == changed.paths
    # and so is an empty one (a copy that never started: numpy raises EOFError on 0 bytes)
    manifest_path(root).write_bytes(b"")
    with image_files_opened() as opened:
        again = index_folder(root)
    assert len(opened) == len(changed.paths) and again.paths == changed.paths

    monkeypatch.setattr(index, "read_size", lambda path: (5, 6))  # as a decoder that reads it now
    mended = index_folder(root)
    assert mended.sizes[mended.paths.tolist().index("dogs/broken.jpg")].tolist() == [5, 6]


def test_many_files_are_read_by_a_pool_to_the_same_sizes(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "images", count=12)
    alone = index_folder(root, index_dir=tmp_path / "alone")
    monkeypatch.setattr(index, "POOL_FROM", 1)
    pooled = index_folder(root, index_dir=tmp_path / "pooled", workers=2)
    assert pooled.paths == alone.paths and np.array_equal(pooled.sizes, alone.sizes)
    assert pooled.reasons == alone.reasons


def test_a_read_only_folder_is_refused_with_the_fix_and_indexed_into_index_dir(tmp_path, monkeypatch, capsys):
    root = make_folder(tmp_path / "images")
    monkeypatch.setattr(index.os, "access", lambda path, mode: False)  # as a read-only mount says
    with pytest.raises(DataError, match=r"set data\.index_dir \(train\.py\) or --index-dir"):
        index_folder(root)
    # the command: one line and exit code 2 (a traceback before), then its own --index-dir
    monkeypatch.setattr(sys, "argv", ["index", str(root)])
    with pytest.raises(SystemExit) as refused:
        index.main()
    assert refused.value.code == 2 and "error: image folder" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["index", str(root), "--index-dir", str(tmp_path / "cache")])
    index.main()
    assert manifest_path(root, tmp_path / "cache").is_file() and not (root / index.MANIFEST_NAME).exists()


def test_a_manifest_that_cannot_be_written_is_refused_in_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    """An index_dir that is a file (or read-only), a full disk: a traceback, and a full disk
    left a partial manifest in the user's image folder at every try."""
    root = make_folder(tmp_path / "images")
    (tmp_path / "a file").touch()
    with pytest.raises(
        DataError, match=r"manifest .*a file/.* cannot be written \(File exists\): give data\.index_dir"
    ):
        index_folder(root, index_dir=tmp_path / "a file")

    def full_disk(file, **arrays):
        file.write(b"half a manifest")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index.np, "savez", full_disk)
    with pytest.raises(DataError, match=r"cannot be written \(No space left on device\)"):
        index_folder(root)
    assert not [path.name for path in root.iterdir() if path.name.startswith(".")]


def test_the_datamodule_plans_from_the_manifest_without_opening_an_image(tmp_path):
    root = make_folder(tmp_path / "images", count=20)
    datamodule = PackedImageDataModule(str(root), patch_size=4, max_patches=64, val_fraction=0.25)
    datamodule.prepare_data()
    with image_files_opened() as opened:
        fresh = PackedImageDataModule(str(root), patch_size=4, max_patches=64, val_fraction=0.25)
        fresh.setup("fit")
        list(fresh.batch_sampler("train"))
    assert opened == []
    assert len(fresh.datasets["train"]) + len(fresh.datasets["val"]) == 20  # the broken file left out


def test_two_writers_of_one_process_id_save_one_manifest(tmp_path, monkeypatch):
    """Processes in containers, or on nodes sharing a file system, may have one process id:
    both wrote a partial file of one name, and the second rename failed."""
    manifest = index_folder(make_folder(tmp_path / "images"))
    both_written = threading.Barrier(2)
    savez = np.savez

    def savez_then_wait(file, **arrays):
        savez(file, **arrays)
        both_written.wait(timeout=30)

    monkeypatch.setattr(index.np, "savez", savez_then_wait)
    failures = []

    def save() -> None:
        try:
            manifest.save(tmp_path / "manifest.npz")
        except OSError as error:
            failures.append(error)

    writers = [threading.Thread(target=save) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert failures == [] and Manifest.load(tmp_path / "manifest.npz").same_as(manifest)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["images", "manifest.npz"]


def test_the_index_command_builds_the_manifest(tmp_path):
    root = make_folder(tmp_path / "images")
    # other files are counted by their suffix: a phone's photos were left out without a word
    for name in ("IMG_1.HEIC", "IMG_2.heic", "README"):
        (root / name).write_bytes(b"")
    result = subprocess.run(
        [sys.executable, "-m", "navit_lightning.data.index", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "indexed 7 image files" in result.stdout + result.stderr
        and "1 unreadable" in result.stdout + result.stderr
        and "; 3 file(s) of other types left out (.heic 2, no suffix 1)" in result.stdout + result.stderr
    )
    assert (root / index.MANIFEST_NAME).is_file()


def test_a_string_table_round_trips_any_path():
    names = ["a/b.png", "", "ünï/ç ode.jpg", "x" * 300]
    table = StringTable.of(names)
    assert table.tolist() == names and table[2] == names[2]
    assert table.take(np.array([3, 0])).tolist() == [names[3], names[0]]


def test_a_folder_that_cannot_be_listed_is_skipped_and_every_suffix_pillow_reads_is_taken(
    tmp_path, monkeypatch, caplog
):
    """A sub-folder its owner keeps to themselves crashed the index with a traceback; the
    .jfif files a browser on Windows saves were left out without a word."""
    root = make_folder(tmp_path / "images")
    (root / "cats" / "private").mkdir()
    Image.new("RGB", (8, 8)).save(root / "cats" / "private" / "0.png")
    Image.new("RGB", (8, 8)).save(root / "cats" / "saved.jfif", "JPEG")
    listable = os.scandir

    def scandir(path):
        if os.path.basename(path) == "private":
            raise PermissionError(13, "Permission denied", str(path))
        return listable(path)

    monkeypatch.setattr(index.os, "scandir", scandir)
    with caplog.at_level(logging.WARNING):
        manifest = index_folder(root)
    assert f"skipping {root / 'cats' / 'private'}: its files cannot be listed" in caplog.text
    assert "cats/saved.jfif" in manifest.paths.tolist()
    assert not [path for path in manifest.paths.tolist() if "private" in path]


def test_a_file_name_that_is_not_utf8_is_indexed_as_listed(tmp_path):
    """An old zip's caf\xe9.jpg (Latin-1) stopped the index with a UnicodeEncodeError."""
    root = make_folder(tmp_path / "images")
    name = os.fsdecode(b"caf\xe9.png")
    Image.new("RGB", (8, 9)).save(root / "cats" / name)
    manifest = index_folder(root)
    row = manifest.paths.tolist().index(f"cats/{name}")
    assert manifest.sizes[row].tolist() == [9, 8]
    assert Manifest.load(manifest_path(root)).paths.tolist() == manifest.paths.tolist()


def test_a_touched_file_is_read_once_and_its_new_stamp_saved(tmp_path):
    """A file rewritten with the same bytes (a copy, a touch) keeps its size: a manifest that
    compared sizes alone with the saved one was not saved, and every later index opened the
    file again."""
    root = tmp_path / "images"
    (root / "cats").mkdir(parents=True)
    for number in range(3):
        Image.new("RGB", (9 + number, 7)).save(root / "cats" / f"{number}.png")
    index_folder(root)
    touched = (root / "cats" / "1.png").stat()
    os.utime(root / "cats" / "1.png", ns=(touched.st_atime_ns, touched.st_mtime_ns + 10**9))
    with image_files_opened() as opened:
        index_folder(root)
    assert opened == ["1.png"]
    saved = Manifest.load(manifest_path(root))
    assert saved.stamps[saved.paths.tolist().index("cats/1.png"), 0] == touched.st_mtime_ns + 10**9
    with image_files_opened() as opened:
        index_folder(root)
    assert opened == []


def test_image_suffixes_are_taken_in_any_case(tmp_path):
    """A camera's B.JPG and an export's Y.PNG are images as a.png is: a suffix compared as
    written left them out of the data set without a word."""
    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(root / "cat" / "a.png")
    Image.new("RGB", (8, 6)).save(root / "cat" / "B.JPG", "JPEG")
    Image.new("RGB", (5, 4)).save(root / "Y.PNG", "PNG")
    manifest = index_folder(root)
    assert manifest.paths.tolist() == ["Y.PNG", "cat/B.JPG", "cat/a.png"]
    assert manifest.readable.all() and manifest.sizes.tolist() == [[4, 5], [6, 8], [6, 8]]


def test_a_link_back_into_its_own_folder_and_a_link_to_a_moved_file_are_skipped(tmp_path, caplog):
    """A class folder linked into itself (cats/again -> cats, a slip of `ln -s`) was walked
    link after link till the kernel refused the path, and a link to an image since moved or
    deleted stopped the index with FileNotFoundError: neither holds an image to learn from.
    The link to nothing is counted in the scan's line (it was left out without a word)."""
    root = make_folder(tmp_path / "images")
    plain = index_folder(root).paths.tolist()
    (root / "cats" / "again").symlink_to(root / "cats", target_is_directory=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "moved.png")
    (root / "dogs" / "moved.png").symlink_to(tmp_path / "moved.png")
    (tmp_path / "moved.png").unlink()
    with caplog.at_level(logging.INFO):
        assert index_folder(root).paths.tolist() == plain
    assert "1 file(s) of other types left out (links to nothing 1)" in caplog.text


def test_a_small_folder_is_read_without_starting_a_pool_whatever_the_workers(tmp_path, monkeypatch):
    """Every run indexes its folder with a worker per CPU core, and a pool takes seconds to
    start (its processes import torch): far more than a small folder's headers, or a refresh
    that reads one file, take in this process."""

    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was started to read a few files")

    monkeypatch.setattr(index, "map_with_progress", no_pool)
    root = make_folder(tmp_path / "images")
    first = index_folder(root, workers=8)
    again = index_folder(root, workers=8)  # the unreadable file is read again
    assert again.paths == first.paths and int(again.readable.sum()) == len(again.paths) - 1


def test_two_folders_of_one_name_keep_manifests_of_their_own_in_index_dir(tmp_path):
    """/data/a/images and /data/b/images indexed into one data.index_dir: one manifest for
    both had each index read the other's files again and write over it."""
    first, second = make_folder(tmp_path / "a" / "images"), make_folder(tmp_path / "b" / "images")
    assert manifest_path(first, tmp_path / "index") != manifest_path(second, tmp_path / "index")
    index_folder(first, index_dir=tmp_path / "index")
    index_folder(second, index_dir=tmp_path / "index")
    assert len(list((tmp_path / "index").glob("images-*.npz"))) == 2
