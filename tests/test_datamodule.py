import gc
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import hydra
import lightning as L
import numpy as np
import pytest
import torch
from einops import rearrange
from PIL import Image
from torch.utils.data import DataLoader

from navit_lightning.batch import PackedBatch
from navit_lightning.bench import train_config
from navit_lightning.data import workers
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.folder import Images, classes_line, hold_out, mirrored
from navit_lightning.data.index import StringTable
from navit_lightning.data.sampler import SampleKey
from navit_lightning.data.workers import WORKER_MODULES
from navit_lightning.train import hold_out_as_its_run
from navit_lightning.utils.callbacks import StoreRunConfig
from navit_lightning.utils.shutdown import descendants
from tests.conftest import REPO, TINY_RUN, TINY_SET, GlooStrategy, bare_trainer, on_two_gloo_ranks, run_whole


def test_train_and_val_folders_are_used_as_given(project_root):
    datamodule = PackedImageDataModule(str(project_root / TINY_SET), patch_size=16, max_patches=64)
    datamodule.setup("fit")
    sizes = {name: len(dataset) for name, dataset in datamodule.datasets.items()}
    assert sizes == {"train": 192, "val": 48, "test": 48}
    assert datamodule.num_classes == 6
    assert datamodule.datasets["train"].hflip == 0.5 and datamodule.datasets["val"].hflip == 0.0


def test_a_flat_folder_is_split_by_seed_and_every_image_is_batched_once(project_root, tmp_path, caplog):
    shutil.copytree(project_root / TINY_SET / "train", tmp_path / "images")
    splits = []
    for _ in range(2):
        datamodule = PackedImageDataModule(
            str(tmp_path / "images"), patch_size=16, max_patches=64, num_workers=0
        )
        with caplog.at_level(logging.INFO):
            datamodule.setup("fit")
        splits.append(datamodule.datasets["val"].images.paths.tolist())
    # without test/, testing is on the val split, and training says so
    assert datamodule.datasets["test"] is datamodule.datasets["val"]
    assert (
        f"no test/<class>/ folders under {tmp_path / 'images'}: the test split is the val split"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):  # eval.py split=val
        PackedImageDataModule(str(tmp_path / "images"), patch_size=16, max_patches=64).setup("validate")
    assert "classes" in caplog.text and "no test/<class>/ folders" not in caplog.text
    assert splits[0] == splits[1] and len(splits[0]) == round(192 * 0.1)
    train_paths = set(datamodule.datasets["train"].images.paths.tolist())
    assert train_paths.isdisjoint(splits[0]) and len(train_paths) == 192 - len(splits[0])

    batches = list(datamodule.val_dataloader())
    assert all(isinstance(batch, PackedBatch) for batch in batches)
    assert sum(batch.num_images for batch in batches) == len(splits[0])


def test_a_folder_no_run_trained_on_is_evaluated_whole(project_root, tmp_path):
    """eval.py on a new folder of <class>/ folders scored the 10 % it held out, and a folder of
    test/ alone was refused."""
    shapes_test = project_root / TINY_SET / "test"
    shutil.copytree(shapes_test, tmp_path / "flat")
    shutil.copytree(shapes_test, tmp_path / "split" / "test")
    shutil.copytree(project_root / TINY_SET / "train", tmp_path / "with_train" / "train")  # test/ is scored
    shutil.copytree(shapes_test, tmp_path / "with_train" / "test")
    for root in (tmp_path / "flat", tmp_path / "split", tmp_path / "with_train"):
        datamodule = PackedImageDataModule(str(root), patch_size=16, max_patches=64, evaluate_all=True)
        datamodule.setup("test")
        assert len(datamodule.datasets["val"]) == len(datamodule.datasets["test"]) == 48
        assert datamodule.num_classes == 6


def test_the_held_out_split_follows_split_seed_not_the_runs_seed(project_root, tmp_path):
    """Runs of a seed sweep, and eval.py (seed 42) on a run of seed 7, hold out the same
    images; a checkpoint from before split_seed (None) holds out by its seed, as it did."""
    shutil.copytree(project_root / TINY_SET / "train", tmp_path / "images")

    def held_out(*overrides: str) -> list[str]:
        cfg = train_config(["data=imagefolder", f"data.root={tmp_path / 'images'}", *overrides])
        datamodule = hydra.utils.instantiate(cfg.data, num_workers=0)
        datamodule.setup("fit")
        return datamodule.datasets["val"].images.paths.tolist()

    assert held_out("seed=7") == held_out("seed=42")
    assert held_out("data.split_seed=1") != held_out()
    assert held_out("data.split_seed=null", "seed=1") == held_out("data.split_seed=1")


def test_images_added_to_a_flat_folder_leave_every_other_image_in_its_split(project_root, tmp_path):
    """A shuffle of them all drew another split: images earlier runs trained on were
    validated (4 of 6 new val images after adding 5 to 60)."""
    shutil.copytree(project_root / TINY_SET / "train", tmp_path / "images")
    added = sorted((project_root / TINY_SET / "val").rglob("*.jpg"))[:20]

    def splits() -> tuple[set[str], set[str]]:
        cfg = train_config(["data=imagefolder", f"data.root={tmp_path / 'images'}"])
        datamodule = hydra.utils.instantiate(cfg.data, num_workers=0)
        datamodule.prepare_data()  # the manifest brought up to date, as a run does
        datamodule.setup("fit")
        return tuple(set(datamodule.datasets[name].images.paths.tolist()) for name in ("train", "val"))

    train, val = splits()
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15  # data.val_fraction, 0.1
    for number, path in enumerate(added):
        shutil.copy(path, tmp_path / "images" / path.parent.name / f"added_{number}.jpg")
    train_after, val_after = splits()
    assert train <= train_after and val <= val_after and len(train_after | val_after) == len(train | val) + 20


@pytest.mark.parametrize("by_path", [True, False])
def test_a_few_images_hold_out_one_at_least(by_path):
    """10 % of 6 images: a draw may fall below 0.1 for none of them, and the val split would
    be empty."""
    paths = [f"cat/{number}.png" for number in range(6)]
    images = Images(Path("/images"), StringTable.of(paths), np.zeros(6, np.int64), np.ones((6, 2), np.int32))
    for seed in range(20):
        train, val = hold_out(images, 0.01, seed, by_path)
        assert len(val.labels) == 1 and len(train.labels) == 5


def test_a_resume_holds_out_what_its_run_held_out(project_root, tmp_path):
    """train.py builds the data from this config: a run from before split_seed and
    split_by_path, resumed, validated on images it had trained on."""
    shutil.copytree(project_root / TINY_SET / "train", tmp_path / "images")

    def held_out(datamodule: PackedImageDataModule) -> list[str]:
        datamodule.setup("fit")
        return datamodule.datasets["val"].images.paths.tolist()

    before = held_out(PackedImageDataModule(str(tmp_path / "images"), seed=7, num_workers=0))
    # eval.py of seed 42 (its own config's), or a resume that set both settings
    resumed = PackedImageDataModule(str(tmp_path / "images"), seed=42, split_seed=0, split_by_path=True)
    resumed.hold_out_as({"seed": 7})  # the old run's data config: neither setting
    assert held_out(resumed) == before
    # nor a resume that changed data.val_fraction: half its val images had trained
    run = PackedImageDataModule(str(tmp_path / "images"), split_by_path=True, num_workers=0)
    resumed = PackedImageDataModule(str(tmp_path / "images"), split_by_path=True, val_fraction=0.2)
    # and the resumed run's checkpoints store the run's split: eval.py tested them on the
    # command's, on trained images, and a later resume trained on held-out ones
    store = StoreRunConfig({"data": {"val_fraction": 0.2, "split_seed": 0, "split_by_path": True}}, [])
    with pytest.warns(
        UserWarning, match=r"data.val_fraction=0.2 left aside: the checkpoint's run held out val_fraction=0.1"
    ):
        hold_out_as_its_run(
            resumed,
            SimpleNamespace(callbacks=[store]),
            {"split_seed": 0, "split_by_path": True, "val_fraction": 0.1},
        )
    assert held_out(resumed) == held_out(run)
    assert store.config["data"] == {"val_fraction": 0.1, "split_seed": 0, "split_by_path": True}


def test_batches_deliver_exactly_the_planned_sizes(project_root):
    datamodule = PackedImageDataModule(
        str(project_root / TINY_SET),
        patch_size=16,
        max_patches=64,
        min_patches=4,
        token_drop_rate=0.3,
        token_drop_by_resolution=True,
        rows=4,
        row_len=64,
        num_workers=0,
    )
    datamodule.setup("fit")
    assert datamodule.train_policy.drop_by_resolution and datamodule.policy("val").drop_rate == 0
    loader = datamodule.train_dataloader()
    planned = list(loader.batch_sampler)
    delivered = list(loader)
    assert len(planned) == len(delivered)
    for keys, batch in zip(planned, delivered, strict=True):
        assert batch.num_images == len(keys)
        assert batch.num_real_tokens == sum(key.keep for key in keys)
        # Dropped tokens keep their place in the image grid.
        real = batch.image_ids >= 0
        assert (batch.coords[real] < batch.grid.max()).all()


def shapes_datamodule(project_root: Path, **options) -> PackedImageDataModule:
    """The tiny shapes set in batches of 4 rows x 64 tokens of 16 px patches."""
    return PackedImageDataModule(
        str(project_root / TINY_SET), patch_size=16, max_patches=64, rows=4, row_len=64, **options
    )


def set_up_on_two_ranks(rank: int, roots: list[Path], early: bool = False) -> str:
    """`rank`'s datamodule set up for a fit from roots[rank], as a ddp rank does; `early`: set
    up before its trainer is attached too, as eval.py's budget check does."""
    datamodule = PackedImageDataModule(str(roots[rank]), patch_size=16, max_patches=36, num_workers=0)
    if early:
        datamodule.setup("fit")
    datamodule.trainer = SimpleNamespace(world_size=2, strategy=GlooStrategy())
    datamodule.setup("fit")
    return "set up"


def test_ranks_that_found_other_images_are_refused_together(tmp_path):
    """Each rank reads data.root itself: copies on each node that differed by one image
    trained 33 of 192 images twice and as many never each epoch, exit 0."""
    for copy in ("node0", "node1", "node1-short"):
        for label in ("a", "b"):
            (tmp_path / copy / label).mkdir(parents=True)
            for index in range(4):
                Image.new("RGB", (40, 24), (index * 50, 0, 0)).save(tmp_path / copy / label / f"{index}.png")
    (tmp_path / "node1-short" / "b" / "3.png").unlink()
    same = on_two_gloo_ranks(set_up_on_two_ranks, [tmp_path / "node0", tmp_path / "node1"])
    assert same == {0: "set up", 1: "set up"}
    for early in (False, True):  # eval.py with patch_budgets set up early: it was not compared
        other = on_two_gloo_ranks(set_up_on_two_ranks, [tmp_path / "node0", tmp_path / "node1-short"], early)
        assert set(other) == {0, 1}
        assert all("the ranks found different images under" in said for said in other.values())


def test_the_longest_training_side_is_at_any_budget_the_policy_draws(tmp_path):
    """What a fit is checked by against the position tables: a very wide image is longer at a
    smaller budget (1 x 20 patches at 30, 2 x 18 at data.max_patches=36)."""
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for index in range(10):
            Image.new("RGB", (338, 25), (index * 20, 0, 0)).save(tmp_path / label / f"{index}.png")
    datamodule = PackedImageDataModule(
        str(tmp_path), patch_size=16, max_patches=36, min_patches=12, num_workers=0
    )
    datamodule.setup("fit")
    (train, train_image), (val, val_image) = (datamodule.longest_side(split) for split in ("train", "val"))
    assert (
        train == 20
        and val == 18
        and Path(train_image).parent.parent == Path(val_image).parent.parent == tmp_path
    )


def test_an_optimizer_step_takes_the_tokens_of_every_rank_and_accumulated_batch(project_root):
    """The effective batch that model.lr_scaling scales the rate to: 4 rows x 64 tokens a
    batch, on 2 ranks, 3 batches accumulated; or on 2 devices of one process."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    assert datamodule.step_tokens() == 4 * 64
    datamodule.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=3, strategy=None)
    assert datamodule.step_tokens() == 2 * 3 * 4 * 64
    # strategy=dp on 2 devices: this process's batch holds both devices' rows
    dp = SimpleNamespace(devices_per_process=2)
    datamodule.trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=1, strategy=dp)
    assert datamodule.process_shape().rows == 2 * 4 and datamodule.step_tokens() == 2 * 4 * 64


def test_token_dropping_keeps_the_tokens_its_epochs_seed_draws(project_root):
    """Each epoch's key seed draws another set of an image's tokens; the same seed, the same set
    (a resumed epoch)."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    dataset = datamodule.datasets["train"]

    def kept(seed: int) -> list[list[int]]:
        return dataset[SampleKey(index=0, max_patches=64, keep=6, seed=seed)].coords.tolist()

    assert kept(1) == kept(1) and kept(1) != kept(2) and len(kept(1)) == 6


def test_an_evaluation_across_patch_budgets_has_a_loader_per_budget(project_root):
    """Each loader scales every image to at most its budget, in rows that hold an image at
    it; afterwards one loader at data.max_patches again."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    datamodule.evaluate_at([4, 100])
    largest = []
    for budget, loader in zip([4, 100], datamodule.val_dataloader(), strict=True):
        batches = list(loader)
        assert sum(batch.num_images for batch in batches) == 48
        assert {batch.image_ids.shape[1] for batch in batches} == {max(64, budget)}
        largest.append(max(int(batch.grid.prod(-1).max()) for batch in batches))
        assert largest[-1] <= budget
    assert largest[1] > 64  # the tiny shapes reach 10 x 10 patches
    datamodule.evaluate_at(None)
    loader = datamodule.val_dataloader()
    assert isinstance(loader, DataLoader) and next(iter(loader)).image_ids.shape[1] == 64
    # one budget with the default rows: a loader of its own, not the one kept before it or after
    for budget, largest_side in ((4, 4), (None, 64)):
        datamodule.evaluate_at(None if budget is None else [budget])
        batches = list(datamodule.val_dataloader())
        assert max(int(batch.grid.prod(-1).max()) for batch in batches) == largest_side


def augmenting_datamodule(root, num_workers: int) -> PackedImageDataModule:
    """Every random choice on: patch budgets, token drops, flips."""
    datamodule = PackedImageDataModule(
        str(root),
        patch_size=16,
        max_patches=64,
        min_patches=4,
        token_drop_beta=(2.0, 6.0),
        rows=4,
        row_len=64,
        num_workers=num_workers,
        seed=5,
    )
    datamodule.setup("fit")
    return datamodule


def assert_same_batches(first: list[PackedBatch], second: list[PackedBatch]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_resumed_loader_delivers_the_rest_of_the_epoch_whatever_its_workers(project_root):
    root = project_root / TINY_SET
    uninterrupted = augmenting_datamodule(root, num_workers=0).train_dataloader()
    whole = list(uninterrupted)
    assert len(whole) > 6
    assert_same_batches(list(augmenting_datamodule(root, num_workers=2).train_dataloader()), whole)

    # Interrupted after 3 training steps: the two workers had read further ahead.
    done = 3
    running = augmenting_datamodule(root, num_workers=2)
    loader = running.train_dataloader()
    batches = iter(loader)
    for _ in range(done + 2):
        next(batches)
    loader.batches_done = lambda: done  # what Lightning's loop reports after 3 steps
    checkpoint = {"datamodule": running.state_dict() or {"train_position": loader.state_dict()}}
    del batches

    resumed = augmenting_datamodule(root, num_workers=1)
    resumed.load_state_dict(checkpoint["datamodule"])
    rest = resumed.train_dataloader()
    assert len(rest) == len(whole)
    assert_same_batches(list(rest), whole[done:])


KILLED_LOADER = """
import os, signal, sys
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.utils.shutdown import descendants

if __name__ == "__main__":
    datamodule = PackedImageDataModule(sys.argv[1], patch_size=16, max_patches=64, num_workers=2)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    batches = iter(loader)
    next(batches)
    print(*descendants(os.getpid()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""
# The pool that generates the built-in set and indexes a folder, killed after its first result
KILLED_POOL = """
import os, signal, time
from navit_lightning.data.workers import map_with_progress
from navit_lightning.utils.shutdown import descendants

if __name__ == "__main__":
    for _ in map_with_progress(time.sleep, [0.5] * 64, "sleeping", workers=2, chunksize=1):
        print(*descendants(os.getpid()), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("killed", [KILLED_LOADER, KILLED_POOL], ids=["loader", "generation-pool"])
def test_loader_workers_end_with_a_training_process_killed_by_sigkill(project_root, tmp_path, killed):
    """Workers start from a forkserver (the data config's default), so their parent is the
    server, not the training process; they must still end with it, and the server with
    them, or they outlive the run and hold its output pipes open."""
    script = tmp_path / "killed.py"
    script.write_text(killed)
    result = subprocess.run(
        [sys.executable, str(script), str(project_root / TINY_SET)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    left = [int(pid) for pid in result.stdout.split()]
    assert len(left) >= 3  # the server and two workers (and the resource tracker)
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in left if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, [Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in alive]


# A scheduler's stop signals every process of the job: the training process (whose own
# handler stops the run at a step's end), the loader workers and their forkserver.
STOPPED_JOB = """
import multiprocessing, os, signal, subprocess, sys, time
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.workers import map_with_progress

def stop_the_job():  # from another process, as a scheduler
    subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"], check=True, start_new_session=True)

def take_an_epoch(root):
    signal.signal(signal.SIGTERM, lambda *_: None)
    datamodule = PackedImageDataModule(root, patch_size=16, max_patches=64, rows=1, num_workers=2)
    datamodule.setup("fit")
    batches = iter(datamodule.train_dataloader())
    next(batches)
    stop_the_job()
    time.sleep(1)
    print(1 + sum(1 for _ in batches), len(datamodule.train_dataloader()), flush=True)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: None)
    if sys.argv[2] == "pool":
        for _ in map_with_progress(time.sleep, [0.5] * 64, "sleeping", workers=2, chunksize=1):
            stop_the_job()
    else:  # in a process multiprocessing started (a ddp_spawn rank), which runs no atexit
        rank = multiprocessing.get_context("spawn").Process(target=take_an_epoch, args=(sys.argv[1],))
        rank.start()
        rank.join(60)
        sys.exit("the rank did not end" if rank.exitcode is None else rank.exitcode)
"""


@pytest.mark.parametrize("stopped", ["loader", "pool"])
def test_a_stop_signalled_to_every_process_ends_a_pool_and_leaves_a_loader_to_its_training_process(
    project_root, tmp_path, stopped
):
    """The loader's workers and their server ignore SIGTERM (they end with the training
    process), so that the training process still has its batches while it stops the run; the
    pools that generate and index data take it, as the process mapping over them does."""
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_JOB)
    result = run_whole(
        [sys.executable, str(script), str(project_root / TINY_SET), stopped],
        timeout=120,
        start_new_session=True,  # its own process group, as a scheduler's job
    )
    if stopped == "pool":
        assert result.returncode == 1 and "BrokenProcessPool" in result.stderr, result.stderr[-2000:]
        return
    # and the process ends with its workers still running: multiprocessing's exit waited for
    # them forever, its SIGTERM ignored, until workers.loader_context
    assert result.returncode == 0, result.stderr[-2000:]
    taken, epoch = map(int, result.stdout.split()[-2:])
    assert taken == epoch > 2 * 2 + 1  # past what the two workers had fetched ahead


def test_loader_workers_and_their_server_start_without_importing_lightning(project_root):
    """The forkserver imports WORKER_MODULES and runs the entry script (as __mp_main__); a
    worker forked from it imports what its dataset, collate_fn and worker_init_fn are defined
    in. Lightning in any of them would add ~2.5 s to the server's start, which every process
    of a run waits for before its first batch, or to every loader's."""
    datamodule = PackedImageDataModule(str(project_root / TINY_SET), num_workers=1)
    datamodule.setup("fit")
    loader = datamodule.val_dataloader()
    handed = (type(loader.dataset), type(loader.collate_fn), loader.worker_init_fn.func)
    modules = [*WORKER_MODULES, *(thing.__module__ for thing in handed)]
    scripts = [str(REPO / f"{name}.py") for name in ("train", "eval", "predict")]
    code = (
        f"import runpy, sys; import {', '.join(modules)}; "
        f"[runpy.run_path(script, run_name='__mp_main__') for script in {scripts}]; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("main_module", "preloads_datamodule"),
    [
        (None, False),  # python train.py: the server runs the script, which imports the rest
        ("navit_lightning.bench.data_loading", True),  # python -m X: X is not preloaded by name
        ("pytest.__main__", False),  # a package's __main__, which no process runs again
    ],
)
def test_the_forkserver_preloads_the_worker_code_and_a_module_mains_datamodule(
    monkeypatch, main_module, preloads_datamodule
):
    """What the server imports once before its first fork, so that no loader worker imports
    it again; and start_context hands it to the server."""
    spec = None if main_module is None else SimpleNamespace(name=main_module)
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=spec))
    datamodule = ["navit_lightning.data.datamodule"] if preloads_datamodule else []
    assert workers.forkserver_preload() == ["__main__", *WORKER_MODULES, *datamodule]
    preloaded = []
    monkeypatch.setattr(multiprocessing.get_context("forkserver"), "set_forkserver_preload", preloaded.append)
    assert workers.start_context("forkserver") is multiprocessing.get_context("forkserver")
    assert preloaded == [["__main__", *WORKER_MODULES, *datamodule]]


def test_a_module_main_starts_its_loader_workers_without_a_warning(project_root):
    """`python -m X` is run again by every worker: a server holding X itself would have
    runpy warn at each worker's start (forkserver_preload)."""
    command = [sys.executable, "-m", "navit_lightning.bench.data_loading", *TINY_RUN, "data.num_workers=1"]
    env = {**os.environ, "PROJECT_ROOT": str(project_root)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loader:" in result.stdout and "RuntimeWarning" not in result.stderr, result.stderr[-2000:]


class RecordBatches(L.LightningModule):
    """Records every training batch; one parameter, so that the optimizer has a step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, PackedBatch]] = []
        self.processes: list[tuple[int, frozenset[int]]] = []  # (epoch, this process's descendants)

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch))
        self.processes.append((self.current_epoch, frozenset(descendants(os.getpid()))))
        return self.weight * 0

    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train_three_epochs(project_root: Path, num_workers: int, **trainer_options) -> RecordBatches:
    """Three epochs of RecordBatches on the tiny shapes set's packed batches, in this process."""
    datamodule = shapes_datamodule(project_root, hflip=0.0, num_workers=num_workers)
    model = RecordBatches()
    trainer = bare_trainer(max_epochs=3, use_distributed_sampler=False, **trainer_options)
    trainer.fit(model, datamodule=datamodule)
    return model


def test_overfit_batches_sees_the_same_batches_every_epoch(project_root):
    """Lightning turns shuffling off for overfit_batches by swapping a loader's sampler; ours
    shuffles inside its batch sampler, where Lightning does not look (it sees the loader's
    SequentialSampler and says nothing), so the datamodule turns it off itself."""
    model = train_three_epochs(project_root, num_workers=0, overfit_batches=2, limit_val_batches=0)
    epochs = [[batch for epoch, batch in model.seen if epoch == e] for e in range(3)]
    assert [len(batches) for batches in epochs] == [2, 2, 2]
    assert_same_batches(epochs[1], epochs[0])
    assert_same_batches(epochs[2], epochs[0])


def test_loader_workers_live_on_from_epoch_to_epoch(project_root):
    """Lightning asks for the loaders again at every epoch (reload_dataloaders_every_n_epochs=1,
    which recounts the train batches); handed the same loaders, their persistent workers go on,
    where new loaders would start new workers at every epoch."""
    # processes an earlier test in this worker left behind may end during this one
    before = set(descendants(os.getpid()))
    model = train_three_epochs(project_root, num_workers=1, reload_dataloaders_every_n_epochs=1)
    # From epoch 1 on, every loader's worker is running (and the forkserver, if this test started it).
    later = {processes - before for epoch, processes in model.processes if epoch > 0}
    assert len(later) == 1, later
    (running,) = later
    assert len(running) >= 2  # a train and a val worker


def test_a_dropped_datamodule_ends_its_loaders_workers_at_once(project_root):
    """As a notebook drops one and makes another. Its training loader held it: the cycle was
    left to the garbage collector, which finalized the loader's queues before the loader and so
    broke torch's shutdown of the persistent workers (10 s a worker, then left running)."""
    datamodule = shapes_datamodule(project_root, num_workers=1)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    next(iter(loader))
    (worker,) = loader._iterator._workers
    gc.disable()  # the collector's pass would come at any time, or never
    try:
        del datamodule, loader
        assert not worker.is_alive()
    finally:
        gc.enable()
    # and a loader that outlives its datamodule still says where its epoch is
    datamodules = [shapes_datamodule(project_root, num_workers=0) for _ in range(2)]
    for datamodule in datamodules:
        datamodule.setup("fit")
    kept, outliving = (datamodule.train_dataloader() for datamodule in datamodules)
    gone = weakref.ref(datamodules.pop())
    del datamodule
    assert gone() is None and outliving.state_dict() == kept.state_dict()


def test_an_interrupted_pass_leaves_the_loaders_workers_to_the_next_one(project_root):
    """Ctrl-C and a notebook's interrupt signal every process of the group, the loader's
    workers too: one that died of it broke the datamodule's persistent loader for every pass
    after ("DataLoader worker exited unexpectedly")."""
    datamodule = shapes_datamodule(project_root, num_workers=1)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    batches = iter(loader)
    next(batches)
    (worker,) = loader._iterator._workers
    os.kill(worker.pid, signal.SIGINT)
    worker.join(timeout=1)  # time to die of it
    del batches  # as the interrupted loop drops it
    assert worker.is_alive() and len(list(datamodule.train_dataloader())) == len(loader)


def test_training_images_are_mirrored_as_their_key_seed_draws_and_evaluation_images_never(tmp_path):
    """data.hflip is the training augmentation: a dataset that kept the setting but never
    applied it trained on unmirrored images alone, without a word; val is never mirrored."""
    pixels = np.zeros((32, 48, 3), dtype=np.uint8)
    pixels[:, :16] = (255, 0, 0)  # red on the left: a mirror shows
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.fromarray(pixels).save(tmp_path / split / name / "0.png")
    datamodule = PackedImageDataModule(str(tmp_path), patch_size=16, max_patches=64, hflip=0.5, num_workers=0)
    datamodule.setup("fit")
    flip, plain = 0, (1 << 24) - 1  # key seeds: low 24 bits all clear, all set
    assert mirrored(flip, 0.5) and not mirrored(plain, 0.5)

    def picture(split: str, seed: int) -> torch.Tensor:
        sample = datamodule.datasets[split][SampleKey(index=0, max_patches=64, keep=64, seed=seed)]
        return rearrange(sample.patches, "(h w) (p1 p2 c) -> (h p1) (w p2) c", w=sample.grid[1], p1=16, p2=16)

    assert torch.equal(picture("train", plain), torch.from_numpy(pixels))
    assert torch.equal(picture("train", flip), torch.from_numpy(pixels).flip(1))
    assert torch.equal(picture("val", flip), torch.from_numpy(pixels))


def test_ddp_ranks_are_dealt_disjoint_shares_of_the_epochs_batches(project_root):
    """Given the whole epoch, every rank trained on every image: each epoch ran as many steps
    as one process, and every image was seen once per rank."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    whole = {key.index for batch in datamodule.batch_sampler("train") for key in batch}
    ranks = []
    for rank in (0, 1):
        datamodule.trainer = SimpleNamespace(world_size=2, global_rank=rank, overfit_batches=0, strategy=None)
        ranks.append({key.index for batch in datamodule.batch_sampler("train") for key in batch})
    assert not ranks[0] & ranks[1] and ranks[0] | ranks[1] == whole


def test_the_loaders_of_a_budget_sweep_end_their_workers_with_their_pass(project_root):
    """They are made anew for every evaluation: workers kept would pile up, a set per sweep."""
    datamodule = shapes_datamodule(project_root, num_workers=1)
    datamodule.setup("fit")
    datamodule.evaluate_at([4, 100])
    assert [loader.persistent_workers for loader in datamodule.val_dataloader()] == [False, False]
    datamodule.evaluate_at(None)
    assert datamodule.val_dataloader().persistent_workers  # kept from epoch to epoch


def test_a_checkpoint_at_the_end_of_an_epoch_cut_short_by_limit_train_batches_is_one_of_an_epochs_end(
    project_root,
):
    """Lightning's count of the epoch's batches reaches trainer.num_training_batches, short of
    the plan: read as mid-epoch, the resume would have trained the rest of that epoch. Ended
    by the trainer once it counts the epoch processed (its validation run)."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    progress, epochs = SimpleNamespace(processed=1), SimpleNamespace(processed=0)
    datamodule.trainer = SimpleNamespace(
        num_training_batches=2,
        fit_loop=SimpleNamespace(
            epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=progress)),
            epoch_progress=SimpleNamespace(current=epochs),
        ),
    )
    assert loader.state_dict()["batches_done"] == 1
    progress.processed = 2
    position = loader.state_dict()
    assert position["batches_done"] == len(loader.batch_sampler) > 2 and not position["epoch_ended"]
    epochs.processed = 1
    assert loader.state_dict()["epoch_ended"]


@pytest.mark.parametrize(
    ("cores", "devices", "dp", "srun_tasks", "expected"),
    [
        (8, 2, None, None, 3),  # Lightning's or torchrun's ranks share the cores they inherit
        (8, 2, SimpleNamespace(devices_per_process=2), None, 7),
        (64, 1, None, None, 8),
        (8, 4, None, "4", 7),  # srun gives each task its own --cpus-per-task
    ],
)
def test_the_default_loader_workers_share_the_cores_and_leave_one_to_each_training_process(
    project_root, monkeypatch, cores, devices, dp, srun_tasks, expected
):
    """Of the cores the process may use: on a node of 128 a SLURM task of 8 started 8 loader
    workers, and its first index 128 processes."""
    datamodule = shapes_datamodule(project_root)  # data.num_workers=null
    datamodule.setup("fit")
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    for name in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    if srun_tasks:
        monkeypatch.setenv("SLURM_STEP_ID", "0")
        monkeypatch.setenv("SLURM_PROCID", "0")
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", srun_tasks)
    datamodule.trainer = SimpleNamespace(
        num_devices=devices, strategy=dp, world_size=1, global_rank=0, overfit_batches=0
    )
    assert datamodule.val_dataloader().num_workers == expected


def fit_at_epoch(epoch: int) -> SimpleNamespace:
    """What a datamodule reads of a one-process Trainer at `epoch`."""
    return SimpleNamespace(
        current_epoch=epoch,
        world_size=1,
        global_rank=0,
        overfit_batches=0,
        limit_train_batches=1.0,
        strategy=None,
        loggers=[],
        accumulate_grad_batches=1,
    )


def test_a_resume_position_holds_for_its_own_epoch_alone(project_root):
    """The train loader of an epoch plans that epoch (Lightning reads its length before it
    sets the epoch), and a checkpoint's position applies once: the epoch after a resumed one
    is whole, and no repeat of the resumed one's rest."""
    root = project_root / TINY_SET
    running = augmenting_datamodule(root, num_workers=0)
    running.trainer = fit_at_epoch(0)
    first_epoch = list(running.train_dataloader())
    running.trainer = fit_at_epoch(1)
    second_epoch = list(running.train_dataloader())
    with pytest.raises(AssertionError):
        assert_same_batches(second_epoch, first_epoch)
    loader = augmenting_datamodule(root, num_workers=0).train_dataloader()
    loader.batches_done = lambda: 3
    resumed = augmenting_datamodule(root, num_workers=0)
    resumed.load_state_dict({"train_position": loader.state_dict()})
    resumed.trainer = fit_at_epoch(0)
    assert_same_batches(list(resumed.train_dataloader()), first_epoch[3:])
    resumed.trainer = fit_at_epoch(1)
    assert_same_batches(list(resumed.train_dataloader()), second_epoch)


def test_each_prediction_reads_the_files_it_was_given(project_root):
    files = sorted((project_root / TINY_SET / "test").rglob("*.*g"))
    datamodule = shapes_datamodule(project_root, num_workers=0)
    for paths in (files[:3], files[3:8]):
        datamodule.predict_on(paths)
        datamodule.setup("predict")
        assert len(datamodule.datasets["predict"]) == len(paths)


@pytest.mark.parametrize("limit", [1.0, 2])
def test_the_effective_batch_is_logged_once_with_the_images_of_every_rank_and_accumulated_batch(
    project_root, limit, caplog
):
    """Its images: the epoch's over its optimizer steps. Rank 0's batches times the ranks
    counted the other ranks' filler batches (no image) as full ones (198 of a folder's 105).
    Under trainer.limit_train_batches (overfit_batches sets it) it printed the whole plan."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))
    for epoch in (0, 1):
        datamodule.trainer = SimpleNamespace(
            current_epoch=epoch,
            world_size=2,
            global_rank=0,
            accumulate_grad_batches=3,
            overfit_batches=0,
            limit_train_batches=limit,
            strategy=None,
            loggers=[logger],
            global_step=0,
        )
        with caplog.at_level(logging.INFO):
            loader = datamodule.train_dataloader()
        if not epoch:  # every training image, over the steps of 3 batches (the last one fewer)
            planned = len(loader.batch_sampler)
            batches = planned if limit == 1.0 else limit
            images = len(datamodule.datasets["train"]) * batches / planned / -(-batches // 3)
    assert logged == [{"effective_batch/tokens": 2 * 3 * 4 * 64, "effective_batch/images": round(images, 1)}]
    shown = "on" if limit == 1.0 else f"of the {planned} planned (limit_train_batches=2)"
    assert f"train: {batches} batches per epoch {shown}" in caplog.text


def test_the_classes_line_counts_each_classs_images_in_each_split():
    """A data.root one level too high (the parent of two copies of the data) trained on the
    copies as its classes without a line to show it."""
    classes = [f"c{number}" for number in range(12)]
    splits = {
        "train": SimpleNamespace(labels=np.array([0, 0, 1, 11])),
        "val": SimpleNamespace(labels=np.array([1])),
    }
    none = ", ".join(f"c{number} 0/0" for number in range(2, 10))
    assert classes_line(Path("/data"), classes, splits) == (
        f"/data: 12 classes, 4 train, 1 val images; train/val by class: c0 2/0, c1 1/1, {none} and 2 more"
    )
