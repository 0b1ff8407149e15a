import errno
import json
import logging
import random
import re
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
from PIL import Image

from navit_lightning.data import shapes
from navit_lightning.errors import ConfigError, DataError

TINY = shapes.ShapesSpec(num_train=6, num_val=6, num_test=6)


def test_generation_is_deterministic_varied_and_done_once(tmp_path, caplog):
    spec = shapes.ShapesSpec(num_train=138, num_val=6, num_test=6)  # train: three chunks of jobs
    with caplog.at_level(logging.INFO, logger=shapes.__name__):
        first = shapes.generate(tmp_path / "a", spec, workers=1)
    # a line for train.log, which the progress bar never reaches
    assert re.search(
        rf"generated the shapes data set in {re.escape(str(first))}: 138 train \+ 6 val \+ 6 test images in",
        caplog.text,
    )
    # pool processes draw other images than in the first: each image depends on its seed alone
    second = shapes.generate(tmp_path / "b", spec, workers=3)
    files = sorted(p.relative_to(first) for p in first.rglob("*.*") if p.suffix in {".png", ".jpg"})
    assert len(files) == 150
    assert {p.parts[1] for p in files} == set(shapes.CLASSES)
    assert all((first / p).read_bytes() == (second / p).read_bytes() for p in files)
    sizes = {Image.open(first / p).size for p in files}
    assert len(sizes) > 20 and all(spec.min_side <= min(size) for size in sizes)
    assert json.loads((first / shapes.DONE_MARKER).read_text())["num_train"] == 138

    (first / files[0]).unlink()  # a finished set of the same spec is not written again
    shapes.generate(first, spec, workers=1)
    assert not (first / files[0]).exists()


def test_a_new_spec_replaces_the_old_images(tmp_path):
    shapes.generate(tmp_path, shapes.ShapesSpec(num_train=12, num_val=6, num_test=6), workers=1)
    shapes.generate(tmp_path, shapes.ShapesSpec(num_train=6, num_val=6, num_test=6, seed=1), workers=1)
    assert len([p for p in (tmp_path / "train").rglob("*.*")]) == 6


def test_a_folder_of_the_users_own_is_refused_and_left_as_it_was(tmp_path):
    """data.root=<own folder> without data=imagefolder: its circle/ was deleted, the set
    written beside the user's classes."""
    mine = tmp_path / "train" / "circle" / "mine.png"
    mine.parent.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(mine)
    with pytest.raises(DataError, match=f"use data=imagefolder data.root={tmp_path}; for the built-in set"):
        shapes.generate(tmp_path, TINY, workers=1)
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [Path(shapes.LOCK_NAME), mine.relative_to(tmp_path)]


@pytest.mark.parametrize("marked", [True, False], ids=["started-marker", "older-version"])
def test_an_interrupted_generation_is_finished_by_the_next_run(tmp_path, marked):
    """An older version wrote no STARTED_MARKER: its cut set holds its own files alone."""
    if marked:
        (tmp_path / shapes.STARTED_MARKER).touch()
    (tmp_path / "train" / "circle").mkdir(parents=True)
    (tmp_path / "val" / "ring").mkdir(parents=True)
    (tmp_path / "train" / "circle" / "000000.jpg").write_bytes(b"cut short")
    shapes.generate(tmp_path, TINY, workers=1)
    assert len(list(tmp_path.rglob("*.jpg")) + list(tmp_path.rglob("*.png"))) == 18
    assert not (tmp_path / shapes.STARTED_MARKER).exists()
    # a finished set is read without the lock, which a read-only copy could not take
    (tmp_path / shapes.LOCK_NAME).unlink()
    shapes.generate(tmp_path, TINY, workers=1)
    assert not (tmp_path / shapes.LOCK_NAME).exists()


def test_a_full_disk_while_generating_names_the_folder_and_a_fix_and_the_next_run_finishes(
    tmp_path, monkeypatch
):
    """It ended in Pillow's AttributeError and three chained OSErrors that named neither."""

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    monkeypatch.setattr(shapes, "map_with_progress", full_disk)
    with pytest.raises(
        DataError, match=rf"^the built-in data set cannot be written in {re.escape(str(tmp_path))} "
    ):
        shapes.generate(tmp_path, TINY, workers=1)
    monkeypatch.undo()
    shapes.generate(tmp_path, TINY, workers=1)
    assert len(list(tmp_path.rglob("*.jpg")) + list(tmp_path.rglob("*.png"))) == 18


def test_two_processes_generating_one_set_make_it_once(tmp_path):
    """Sweep jobs on a fresh clone, or nodes on a shared file system: the second crashed on
    the first's folders, or the first marked a set finished that the second had cut."""
    code = (
        "import sys; from navit_lightning.data import shapes; "
        "shapes.generate(sys.argv[1], shapes.ShapesSpec(num_train=600, num_val=6, num_test=6), workers=1)"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    errors = [run.communicate(timeout=240)[1].decode() for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    images = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.suffix in {".jpg", ".png"})
    assert len(images) == 612 and (tmp_path / shapes.DONE_MARKER).exists()


def test_a_moved_runs_built_in_data_is_read_in_this_data_dir_unless_another_set_is_there(tmp_path):
    """Its stored root is the old clone's (eval.py made the set there, or a traceback where
    that path could not be written), or data/shapes from before each set had a folder of its
    own: eval.py reads the set's own folder in this data_dir, never one holding another set."""
    spec = {"_target_": "navit_lightning.data.shapes.ShapesSpec", **asdict(TINY)}
    old_clone = tmp_path / "old" / "data" / "shapes"
    here = tmp_path / "here"
    tiny_here = here / shapes.folder_name(spec)
    assert tiny_here.name.startswith("shapes-")
    assert shapes.root_for_run(str(old_clone), str(here), spec) == str(tiny_here)
    shapes.generate(tiny_here, TINY, workers=1)  # the same set made here: read
    assert shapes.root_for_run(str(old_clone), str(here), spec) == str(tiny_here)
    other = {**spec, "num_train": TINY.num_train + 1}  # its own folder beside it
    assert shapes.root_for_run(str(old_clone), str(here), other) == str(here / shapes.folder_name(other))
    old_clone.mkdir(parents=True)  # the run's own folder, where it is still there
    assert shapes.root_for_run(str(old_clone), str(here), other) == str(old_clone)
    # data/shapes holds the tiny set (the older layout): a run of the default set trained on
    # its images before they were replaced; making its set there would replace them again
    default = {"_target_": "navit_lightning.data.shapes.ShapesSpec", **asdict(shapes.ShapesSpec())}
    shapes.generate(here / "shapes", TINY, workers=1)
    with pytest.raises(DataError, match=r"\(.*/here/shapes\) holds another set now \(num_test=6 there"):
        shapes.root_for_run(str(here / "shapes"), str(here), default)
    # and a run of the tiny set that read data/shapes finds its images there still
    assert shapes.root_for_run(str(here / "shapes"), str(here), spec) == str(here / "shapes")


def test_splits_draw_other_images_and_shapes_come_wide_and_tall(tmp_path):
    """Each split's image i has its own seed: val and test are not copies of train's."""
    root = shapes.generate(tmp_path, TINY, workers=1)
    for name in ("000000.png", "000001.jpg"):
        images = [next((root / split).rglob(name)).read_bytes() for split in ("train", "val", "test")]
        assert len(set(images)) == 3, name
    spec = shapes.ShapesSpec(num_train=30, num_val=6, num_test=6, max_aspect=3.0)
    sizes = [shapes.render(i % 6, random.Random(i), spec).size for i in range(30)]
    assert any(width > height for width, height in sizes) and any(width < height for width, height in sizes)


def test_an_interrupted_replacement_leaves_no_finished_marker(tmp_path, monkeypatch):
    """The old spec's marker over half-replaced images: a run of that spec took the mix as its set."""
    shapes.generate(tmp_path, TINY, workers=1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "map_with_progress", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shapes.generate(tmp_path, shapes.ShapesSpec(num_train=6, num_val=6, num_test=6, seed=1), workers=1)
    assert shapes.made_here(tmp_path) is None


def test_a_process_that_waited_for_the_lock_does_not_write_the_set_again(tmp_path, monkeypatch):
    """The set another process finished while this one waited is read as it is, not rewritten
    under whatever reads it already."""
    from filelock import FileLock

    writes, waiting_for_the_lock = [], threading.Event()
    write_set = shapes._write_set
    monkeypatch.setattr(shapes, "_write_set", lambda *args: writes.append(args))
    monkeypatch.setattr(shapes.log, "info", lambda *args: waiting_for_the_lock.set())
    lock = FileLock(tmp_path / shapes.LOCK_NAME)
    lock.acquire()
    waiting = threading.Thread(target=shapes.generate, args=(tmp_path, TINY, 1))
    waiting.start()
    assert waiting_for_the_lock.wait(timeout=60)  # it found no finished set
    write_set(tmp_path, TINY, 1)  # the other process
    lock.release()
    waiting.join(timeout=60)
    assert not waiting.is_alive() and writes == []


def test_the_spec_takes_equal_bounds_and_refuses_a_bool_aspect():
    shapes.ShapesSpec(min_side=64, max_side=64, max_aspect=1)  # one size, square images: allowed
    with pytest.raises(ConfigError, match="max_aspect=True must be 1 or above"):
        shapes.ShapesSpec(max_aspect=True)


def test_an_aspect_given_as_a_whole_number_names_the_same_folder():
    """data.generate.max_aspect=3 and 3.0 make the same images: one folder, not two copies."""
    assert shapes.folder_name({"max_aspect": 3}) == shapes.folder_name({"max_aspect": 3.0}) != "shapes"


def test_a_users_file_named_by_a_number_is_not_taken_for_a_generated_one(tmp_path):
    """Only NNNNNN.png/.jpg is the generator's: a user's train/circle/12.png was deleted."""
    mine = tmp_path / "train" / "circle" / "12.png"
    mine.parent.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(mine)
    with pytest.raises(DataError, match="did not write"):
        shapes.generate(tmp_path, TINY, workers=1)
    assert mine.exists()
