"""Checkpoints: written atomically, refused with one line when unusable, resumed with
ckpt_path=last."""

import logging
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import hydra
import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.progress import _BatchProgress, _ProcessedTracker, _Progress
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import OmegaConf, open_dict

from navit_lightning import CONFIG_DIR
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.errors import ConfigError, DataError, OutputError
from navit_lightning.train import build, resume_from
from navit_lightning.utils.checkpoints import (
    AtomicCheckpointIO,
    BestCheckpoint,
    ResumeCheckpoint,
    check_resumable,
    check_same_classes,
    load_initial_weights,
    read_checkpoint,
    resume_epoch_ends_as_ended,
    saved_as_before_validation,
)
from navit_lightning.utils.entry_point import refusal
from navit_lightning.utils.instantiate import absolute_path
from navit_lightning.utils.rebuild import data_for, data_keys_given, same_folder
from tests.conftest import DDP_TWO_RANKS, TINY_RUN, TINY_SHAPES, bare_trainer, logged_scalars
from tests.interruptions import InterruptAtStep


@pytest.mark.parametrize("task", ["eval", "predict"])
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], {"rows": 4, "num_workers": 3, "lookahead": 512}),
        (["data.rows=2", "+data.lookahead=8"], {"rows": 2, "num_workers": 3, "lookahead": 8}),
        (["data.num_workers=0"], {"rows": 4, "num_workers": 0, "lookahead": 512}),
    ],
)
def test_eval_and_predict_take_the_runs_data_with_what_the_command_changes(task, overrides, expected):
    run = OmegaConf.create({"data": {"_target_": "the.runs.DataModule", **dict.fromkeys(expected, None)}})
    run.data.update(rows=4, num_workers=3, lookahead=512)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(task, overrides=["ckpt_path=run.ckpt", *overrides])
    assert OmegaConf.to_container(data_for(cfg, run)) == {"_target_": "the.runs.DataModule", **expected}


def test_an_evaluation_given_a_patch_budget_past_the_runs_rows_lengthens_them():
    """+data.max_patches=200 on a run of 144-token rows was refused as a training shape, where
    patch_budgets=[200] lengthened the rows."""
    run = OmegaConf.create({"data": {"_target_": "the.runs.DataModule", "max_patches": 36, "row_len": 144}})
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for budget, row_len in ((200, 200), (100, 144)):
            cfg = compose("eval", overrides=["ckpt_path=run.ckpt", f"+data.max_patches={budget}"])
            assert (data_for(cfg, run).max_patches, data_for(cfg, run).row_len) == (budget, row_len)


def test_the_stored_data_root_is_absolute_but_for_a_url(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert absolute_path("images") == str(tmp_path / "images")
    assert absolute_path(2024) == str(tmp_path / "2024")  # a folder Hydra reads as a number
    assert absolute_path("s3://bucket/images") == "s3://bucket/images"  # a data module's own


def built_model(*overrides: str):
    """A LightningModule of the train config with `overrides`, and its model config."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["model.net.dim=32", "model.net.heads=2", *overrides])
    return hydra.utils.instantiate(cfg.model), cfg.model


def test_resuming_another_network_other_classes_or_an_ema_run_without_ema_is_refused(tmp_path, caplog):
    model, config = built_model("model.num_classes=3")
    classes = ["bird", "cat", "dog"]
    path = tmp_path / "last.ckpt"
    run_config = {"model": OmegaConf.to_container(config, resolve=True)}
    weights = {"state_dict": model.state_dict(), "run_config": run_config, "class_names": classes}
    torch.save(weights, path)  # save_weights_only: tested by train=false, not resumed (a traceback)
    check_resumable(model, config, path, False, classes, fitting=False)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"holds weights alone (no optimizer or loop state to resume): start a fit from them with "
            f"init_from={path}"
        ),
    ):
        check_resumable(model, config, path, False, classes)
    torch.save({**weights, "optimizer_states": []}, path)
    check_resumable(*built_model("model.num_classes=3", "optimizer.weight_decay=0.5"), path, False, classes)
    # the command's schedule function runs from the restored step: another floor, without a word
    other_schedule = built_model(
        "model.num_classes=3", "scheduler.min_lr_ratio=0.5", "scheduler.warmup_steps=7"
    )
    caplog.clear()
    check_resumable(*other_schedule, path, False, classes, fitting=False)
    assert "schedule settings" not in caplog.text
    check_resumable(*other_schedule, path, False, classes)
    assert (
        "resumed with this command's schedule settings: scheduler.min_lr_ratio 0.01 -> 0.5, "
        "scheduler.warmup_steps 100 -> 7\n" in caplog.text
    )
    # a sweep resumed with its seeds in another order: seed=0's job went on from seed 1's run
    torch.save({**weights, "optimizer_states": [], "run_config": {**run_config, "seed": 1}}, path)
    check_resumable(model, config, path, False, classes, seed=1)
    check_resumable(model, config, path, False, classes, fitting=False, seed=0)  # evaluated
    with pytest.raises(ConfigError, match=re.escape(f"{path} was trained with seed=1, not 0: a resumed run")):
        check_resumable(model, config, path, False, classes, seed=0)
    torch.save({**weights, "optimizer_states": []}, path)
    # its rate and schedule resume as saved: the run trained at 5e-4, its config said 1e-2
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"ckpt_path={path} trained at optimizer.lr=0.0005, not 0.01: a resumed run keeps its "
            f"checkpoint's rate and schedule; resume with optimizer.lr=0.0005, or start a fit from its "
            f"weights with init_from={path}"
        ),
    ):
        check_resumable(*built_model("model.num_classes=3", "optimizer.lr=1e-2"), path, False, classes)
    check_resumable(
        *built_model("model.num_classes=3", "optimizer.lr=1e-2"), path, False, classes, fitting=False
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "another network (model.net.dim=32 there, 64 here): resume with the settings it was "
            "trained with (model.net.dim=32)"
        ),
    ):
        check_resumable(*built_model("model.num_classes=3", "model.net.dim=64"), path, True, classes)
    # another head: no model.net setting differs, the head's tensors do (Lightning failed in
    # every rank on a page of size mismatches)
    with pytest.raises(
        ConfigError, match=re.escape("another network (model.head=linear there, bn_mlp here)")
    ):
        check_resumable(*built_model("model.num_classes=3", "model.head=bn_mlp"), path, False, classes)
    # the same tensors, each position-table row another position; how it runs may change
    with pytest.raises(ConfigError, match=re.escape("(model.net.fractional_pos=False there, True here)")):
        check_resumable(
            *built_model("model.num_classes=3", "model.net.fractional_pos=true"), path, True, classes
        )
    check_resumable(
        *built_model("model.num_classes=3", "model.net.attention=sdpa", "model.net.grad_checkpointing=true"),
        path,
        False,
        classes,
    )
    # the cat folder renamed: the same number of classes, each label after it shifted
    with pytest.raises(ConfigError, match=re.escape("(1 not trained on: kitty; 1 missing: cat): use data")):
        check_resumable(model, config, path, False, ["bird", "dog", "kitty"])
    # a class folder added: its model has another head, and was refused as another network
    with pytest.raises(ConfigError, match=re.escape("(1 not trained on: eel): use data")):
        check_resumable(*built_model("model.num_classes=4"), path, False, [*classes, "eel"])
    averaged = tmp_path / "ema.ckpt"
    state = model.state_dict()
    torch.save(
        {"state_dict": state, "current_model_state": state, "run_config": run_config, "optimizer_states": []},
        averaged,
    )
    check_resumable(model, config, averaged, True, classes)  # saved before the names were: numbered
    with pytest.raises(ConfigError, match=r"was written with callbacks=ema \(its weights are the average\)"):
        check_resumable(model, config, averaged, False, classes)


def test_init_from_loads_the_network_and_the_head_only_for_the_same_classes(tmp_path):
    trained, config = built_model("model.num_classes=3")
    path = tmp_path / "last.ckpt"
    run_config = {"model": OmegaConf.to_container(config, resolve=True)}
    torch.save(
        {"state_dict": trained.state_dict(), "run_config": run_config, "class_names": ["a", "b", "c"]}, path
    )

    def same(one: torch.nn.Module, other: torch.nn.Module | dict) -> bool:
        state, others = one.state_dict(), other if isinstance(other, dict) else other.state_dict()
        return state.keys() == others.keys() and all(torch.equal(state[k], others[k]) for k in state)

    for classes, head, head_loaded in [
        (["a", "b", "c"], "linear", True),
        (["a", "b", "z"], "linear", False),
        (["a", "b", "c", "d"], "linear", False),
        (["a", "b", "c"], "bn_mlp", False),  # the same classes, another head: a new one
    ]:
        model, config = built_model(
            f"model.num_classes={len(classes)}", "optimizer.lr=1e-2", f"model.head={head}"
        )
        new_head = {name: t.clone() for name, t in model.head.state_dict().items()}
        assert not same(model.net, trained.net)
        load_initial_weights(model, config, path, classes)
        assert same(model.net, trained.net)
        if head_loaded:
            assert same(model.head, trained.head)
        else:
            assert same(model.head, new_head)

    other, config = built_model("model.num_classes=4", "model.net.depth=2")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "another network (model.net.depth=4 there, 2 here): start with the model.net settings "
            "it was trained with (model.net.depth=4)"  # the overrides to add, as max_grid=36
        ),
    ):
        load_initial_weights(other, config, path, ["a", "b", "c", "d"])
    other, config = built_model("model.num_classes=3", "model.net.fractional_pos=true")
    with pytest.raises(ConfigError, match=re.escape("(model.net.fractional_pos=False there, True here)")):
        load_initial_weights(other, config, path, ["a", "b", "c"])


def test_eval_on_a_data_group_takes_its_images_with_the_runs_sizes_and_what_the_command_sets(tmp_path):
    """The group's own defaults (imagefolder's max_patches=36) would have evaluated a network
    at other sizes than it was trained at, without a word."""
    target = "navit_lightning.data.datamodule.PackedImageDataModule"
    run = OmegaConf.create(
        {
            "data": {
                "_target_": target,
                "root": "trained/on",
                "max_patches": 144,
                "rows": 4,
                "generate": {"n": 1},
            }
        }
    )
    overrides = ["ckpt_path=run.ckpt", "data=imagefolder", f"data.root={tmp_path}", "data.rows=2"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=overrides)
    data = data_for(cfg, run, given={"root", "rows"})
    assert data._target_ == target and data.root == str(tmp_path) and data.generate is None
    assert data.max_patches == 144 and data.rows == 2 and data.evaluate_all  # not the run's folder
    # a copy or shards of the run's folder, said so: its split held out (it was overridden)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=[*overrides, "data.evaluate_all=false"])
    assert data_for(cfg, run, given={"root", "rows", "evaluate_all"}).evaluate_all is False
    # the run's own folder, written another way: its held-out split, not all of it
    run.data.root = str(Path.home() / "images")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=["ckpt_path=run.ckpt", "data=imagefolder", "data.root='~/images'"])
    assert not data_for(cfg, run, given={"root"}).get("evaluate_all")
    # a datamodule of another class: the group as it is
    other = OmegaConf.create({"data": {"_target_": "the.runs.DataModule", "rows": 4}})
    assert data_for(cfg, other, given={"root", "rows"}) == cfg.data
    # of one's own, derived from the project's: the run's settings (they were dropped)
    own = OmegaConf.create({"data": {**run.data, "_target_": f"{__name__}.OwnDataModule"}})
    assert data_for(cfg, own, given={"root"})._target_ == own.data._target_
    assert data_for(cfg, own, given={"root"}).max_patches == 144


class OwnDataModule(PackedImageDataModule):
    """A datamodule of one's own, derived from the project's."""


def test_the_runs_folder_mounted_at_another_path_is_the_runs_folder(tmp_path):
    """A container's bind mount, or a second NFS mount: eval.py scored its trained images."""
    (tmp_path / "images").mkdir()
    (tmp_path / "mounted").mkdir()
    mounted = subprocess.run(
        ["mount", "--bind", tmp_path / "images", tmp_path / "mounted"], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("bind mounts need root in a namespace that allows them")
    try:
        assert same_folder(str(tmp_path / "mounted"), str(tmp_path / "images"))
        assert not same_folder(str(tmp_path), str(tmp_path / "images"))
    finally:
        subprocess.run(["umount", tmp_path / "mounted"], check=True)


def test_eval_on_a_data_group_takes_the_data_settings_of_configs_local(tmp_path):
    """configs/local applies to eval.py too (README): under data=imagefolder its data.rows
    gave way to the run's, as a setting of the group's own would."""
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs, ignore=shutil.ignore_patterns("local"))
    (configs / "local").mkdir()
    # as the README writes it, and with a defaults list of its own
    (configs / "local" / "default.yaml").write_text(
        "defaults:\n  - override /logger: csv\ndata:\n  rows: 1\n"
    )
    run = OmegaConf.create(
        {
            "data": {
                "_target_": "navit_lightning.data.datamodule.PackedImageDataModule",
                "root": "trained/on",
                "rows": 4,
            }
        }
    )
    overrides = ["ckpt_path=run.ckpt", "data=imagefolder", f"data.root={tmp_path}"]
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose("eval", overrides=overrides, return_hydra_config=True)
        HydraConfig().set_config(cfg)
        given = data_keys_given()
    assert given == {"root", "rows"} and data_for(cfg, run, given).rows == 1


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)

    def killed_midway(obj, f, *args, **kwargs):
        with open(f, "wb") as partial:
            partial.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no partial file left

    def full_disk(obj, f, *args, **kwargs):
        with open(f, "wb") as partial:
            partial.write(b"PK\x03\x04 half a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    # one line naming the file (two chained tracebacks before, which named none)
    monkeypatch.setattr(torch, "save", full_disk)
    said = rf"^checkpoint {re.escape(str(path))} cannot be written \(unexpected pos 64 vs 0; [0-9.]+ MiB free"
    with pytest.raises(OutputError, match=said) as failed:
        io.save_checkpoint({"step": 2}, path)
    # TensorBoard's flush, as Lightning ends the fit, failed on the same disk: the line stays
    try:
        raise failed.value
    except OutputError:
        try:
            raise OSError(28, "No space left on device")
        except OSError as flush_failed:
            assert refusal(flush_failed) == str(failed.value)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    (tmp_path / "a file").touch()
    # no space to free: it said to free space on any error
    with pytest.raises(
        OutputError, match=r"a file/last\.ckpt cannot be written \(File exists\): resume in a"
    ):
        io.save_checkpoint({"step": 2}, tmp_path / "a file" / "last.ckpt")


def test_a_saved_checkpoint_is_on_the_disk_before_its_name(tmp_path, monkeypatch):
    """A node that lost power could come back with last.ckpt naming a short file."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)
    assert synced == [str(tmp_path / ".last.ckpt.partial"), str(tmp_path)]


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("missing", "does not exist"),
        ("truncated", "it is truncated or damaged"),
        ("a flipped byte", "is damaged"),
        ("foreign", "is not a checkpoint of navit_lightning's train.py"),
        ("weights alone", "is not a checkpoint of navit_lightning's train.py"),
        ("not a zip", "is not a checkpoint (not the zip archive"),  # "truncated or damaged"
        ("empty", "is empty or truncated"),
    ],
)
def test_unusable_checkpoints_are_refused_with_the_fix(tmp_path, damage, said):
    path = tmp_path / "last.ckpt"
    weights = torch.arange(1000, dtype=torch.float32)
    good = {"state_dict": {"w": weights}, "run_config": {"seed": 1}}
    if damage == "truncated":
        torch.save(good, path)
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "a flipped byte":  # in a weight: torch would load it without a word
        torch.save(good, path)
        data = bytearray(path.read_bytes())
        data[data.find(weights.numpy().tobytes()) + 2001] ^= 1
        path.write_bytes(data)
    elif damage == "foreign":
        torch.save({"model": torch.zeros(3)}, path)
    elif damage == "weights alone":  # a Lightning checkpoint of another project: no run to rebuild
        torch.save({"state_dict": {"w": weights}}, path)
    elif damage == "not a zip":
        path.write_text("hello")
    elif damage == "empty":
        path.write_bytes(b"")
    with pytest.raises(ConfigError, match=f"ckpt_path={path}") as refused:
        read_checkpoint(path)
    assert said in str(refused.value)


def test_a_trainer_resuming_as_by_epochs_still_pickles():
    """ddp_spawn pickles the trainer for its ranks: a lambda there failed every resume."""
    trainer = bare_trainer(max_steps=20)
    resume_epoch_ends_as_ended(trainer)
    assert pickle.loads(pickle.dumps(trainer)).fit_loop._iteration_based_training() is False


def test_ckpt_path_last_without_a_callback_saving_one_is_refused():
    """callbacks=none or trainer.enable_checkpointing=false: it started afresh in a folder
    holding a last.ckpt, its logs over the run's."""
    with pytest.raises(ConfigError, match=r"ckpt_path=last resumes the last checkpoint .+ none saves one"):
        resume_from("last", bare_trainer())


def test_a_whole_checkpoint_passes(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "run_config": {"seed": 1}}, path)
    assert read_checkpoint(path)["run_config"] == {"seed": 1}


def test_eval_data_must_have_the_checkpoints_classes():
    check_same_classes(["blue", "red"], ["blue", "red"], 2, "run.ckpt")
    check_same_classes(["blue", "red"], None, 2, "old.ckpt")  # saved before the names were
    with pytest.raises(ConfigError, match=r"\(1 not trained on: zebra; 1 missing: red\): use data"):
        check_same_classes(["blue", "zebra"], ["blue", "red"], 2, "run.ckpt")
    with pytest.raises(ConfigError, match=r"old.ckpt was trained on \(3 not trained on: a, b, c; 2 missing"):
        check_same_classes(["a", "b", "c"], None, 2, "old.ckpt")
    # folders named by number are names: 1..3 against 0..2 shifted every label without a word
    with pytest.raises(ConfigError, match=r"\(1 not trained on: 3; 1 missing: 0\)"):
        check_same_classes(["1", "2", "3"], ["0", "1", "2"], 3, "digits.ckpt")


@pytest.mark.slow
def test_periodic_last_checkpoint_before_validation_then_ckpt_path_last_resumes(run_entry_point):
    run = run_entry_point.root / "run"
    common = [*TINY_RUN, f"hydra.run.dir={run}", "callbacks.resume_checkpoint.train_time_interval=null"]
    # Stopped at step 3 of the first epoch: no validation yet, last.ckpt from step 2.
    every_2 = "callbacks.resume_checkpoint.every_n_train_steps=2"
    run_entry_point("train.py", *common, every_2, "trainer.max_steps=3")
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] in (2, 3)
    assert not list((run / "checkpoints").glob("epoch_*.ckpt"))  # the best-by-val/acc waits for validation

    resumed = run_entry_point("train.py", *common, "ckpt_path=last", "trainer.max_epochs=2")
    output = resumed.stdout + resumed.stderr
    assert f"Restoring states from the checkpoint path at {run / 'checkpoints' / 'last.ckpt'}" in output
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1  # the second
    assert not list((run / "checkpoints").glob("last-*.ckpt"))


@pytest.mark.slow
def test_init_from_starts_from_the_runs_weights(run_entry_point):
    short = [*TINY_RUN, "test=false", "patch_budgets=null"]
    source = run_entry_point.root / "source"
    run_entry_point("train.py", *short, f"hydra.run.dir={source}")
    tuned = run_entry_point.root / "tuned"
    # At learning rate 0 the fine-tuning run validates the source's final weights.
    result = run_entry_point(
        "train.py",
        *short,
        f"hydra.run.dir={tuned}",
        f"init_from={source}/checkpoints/last.ckpt",
        "optimizer.lr=0",
    )
    assert "loaded its network and head (the same classes)" in result.stdout + result.stderr
    val_loss = [logged_scalars(run / "tensorboard")["val/loss"][-1][1] for run in (source, tuned)]
    assert val_loss[1] == pytest.approx(val_loss[0], rel=1e-6)
    fresh = run_entry_point(
        "train.py", *short, f"hydra.run.dir={run_entry_point.root / 'fresh'}", "optimizer.lr=0"
    )
    assert logged_scalars(run_entry_point.root / "fresh" / "tensorboard")["val/loss"][-1][1] != pytest.approx(
        val_loss[0], rel=1e-3
    ), fresh.stdout[-2000:]


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_starts_fresh_and_a_bad_one_is_refused(run_entry_point):
    """A fresh start is a warning (a run folder named wrong trains from scratch, exit code 0)."""
    fresh = run_entry_point("train.py", *TINY_RUN, "ckpt_path=last")
    output = fresh.stdout + fresh.stderr
    assert re.search(
        r"train.py:\d+: ckpt_path=last: no last checkpoint \(\S+/checkpoints/last.ckpt\): starting afresh "
        r"\(a run resumes in its own folder: hydra.run.dir=",
        output,
    )
    assert "save_last=True" not in output  # Lightning's advice, which the config already follows
    bad = run_entry_point.root / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    refused = run_entry_point("train.py", *TINY_RUN, f"ckpt_path={bad}", check=False)
    assert refused.returncode == 2
    assert f"error: ckpt_path={bad} cannot be read" in refused.stdout + refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["error", "sigterm"])
@pytest.mark.parametrize("ranks", [[], DDP_TWO_RANKS], ids=["1", "ddp2"])
def test_an_error_or_a_signal_mid_epoch_leaves_last_ckpt_at_that_step(run_entry_point, how, ranks):
    run = run_entry_point.root / "run"
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        *ranks,
        f"hydra.run.dir={run}",
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        "+callbacks.interrupt.step=3",  # of 8 in the first epoch: no epoch-end save yet
        f"+callbacks.interrupt.how={how}",
        check=False,
    )
    output = result.stdout + result.stderr
    checkpoints = run / "checkpoints"
    if how == "error" and ranks:
        # An error is one rank's as far as a rank can tell, and a save needs every rank: a rank
        # that failed alone waited in the save's barrier for collective_timeout_s (300 s), then
        # ended with the barrier's error in place of its own.
        assert result.returncode == 1 and not checkpoints.exists()
        assert "RuntimeError: interrupted at step 3 on purpose" in output
        assert "at step 3, not saved (every rank would have to join the save)" in output
        return
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 3
    # Under ddp only the last rank gets SIGTERM, and every rank stops before step 3. Lightning's
    # own handling left them in different collectives until the watchdog stopped them.
    exception = "SIGTERMException" if how == "sigterm" else "RuntimeError"
    said = f"stopped at step 3 ({exception}): saved {checkpoints / 'last.ckpt'}, which "
    # the folder too: ckpt_path=last alone started a new run folder, and found no checkpoint
    said += f"ckpt_path=last hydra.run.dir={run} resumes from"
    assert output.count(said) == 1, output[-3000:]
    assert "not handled within" not in output
    assert result.returncode == (128 + signal.SIGTERM if how == "sigterm" else 1)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # written once, nothing else
    if ranks:  # a resume would need two ranks; a test of its weights takes any number
        tested = run_entry_point(
            "train.py",
            *TINY_RUN,
            "train=false",
            f"ckpt_path={checkpoints / 'last.ckpt'}",
            "patch_budgets=null",
        )
        assert re.search(r"test/acc\s+│\s+[0-9.]+", tested.stdout)


def test_slurms_requeue_signal_stops_the_run_saves_and_requeues_the_job(run_entry_point):
    """SIGUSR1 under SLURM (Lightning's recipe: #SBATCH --signal=USR1@90): Lightning's own
    handler saved hpc_ckpt_1.ckpt, which ckpt_path=last never reads, from inside a barrier the
    other ddp ranks did not reach (they hung or timed out). SLURM signals every process of the
    step: the loader workers, their server and the resource tracker died of it, and the run
    ended on a ConnectionResetError (exit 1, not requeued)."""
    run, bin_dir = run_entry_point.root / "run", run_entry_point.root / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {run_entry_point.root / "scontrol"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    slurm |= {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "navit", "SLURM_NODELIST": "localhost"}
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        f"hydra.run.dir={run}",
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        "data.num_workers=1",
        "trainer.max_epochs=2",
        "+callbacks.interrupt.step=11",  # epoch 1: its workers started by the forkserver
        "+callbacks.interrupt.how=sigusr1_to_all",
        check=False,
        env={**slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGUSR1, output[-3000:]
    assert (
        "rank 0: SIGUSR1: every rank stops before its next training step, then the job is requeued" in output
    )
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 11
    assert (run_entry_point.root / "scontrol").read_text().split() == ["requeue", "77"]
    assert "requeued SLURM job 77" in output
    assert "Traceback" not in output  # the resource tracker's KeyErrors, once it had died of it


def test_an_error_on_one_ddp_rank_ends_the_run_at_once_with_that_error(run_entry_point):
    """That rank waited in the save's barrier, which the others never reach, for
    collective_timeout_s, then ended with the barrier's error; its own was never shown."""
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        *DDP_TWO_RANKS,
        "trainer.strategy.collective_timeout_s=600",  # a wait for it would outlast the test
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        "+callbacks.interrupt.step=3",
        "+callbacks.interrupt.how=error_on_last_rank",
        check=False,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "RuntimeError: interrupted at step 3 on purpose" in output, output[-3000:]


@pytest.mark.slow
def test_eval_refuses_a_missing_checkpoint_with_one_line(run_entry_point):
    missing = run_entry_point.root / "nowhere.ckpt"
    refused = run_entry_point("eval.py", f"ckpt_path={missing}", check=False)
    assert refused.returncode == 2
    assert f"error: ckpt_path={missing} does not exist" in refused.stdout + refused.stderr


STOPPED_EXIT_CODES = {"sigkill": -signal.SIGKILL, "sigterm": 128 + signal.SIGTERM, "error": 1}


def stop_at_step(
    run_entry_point, command: list[str], folder: Path, step: int, how: str = "sigkill", batch: int = 0
) -> None:
    """Run train.py with `command` in `folder` and stop it (`how`: sigkill, sigterm, error) at
    training step `step`'s batch `batch` (tests/interruptions.py)."""
    stopped = run_entry_point(
        "train.py",
        *command,
        f"hydra.run.dir={folder}",
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        f"+callbacks.interrupt.step={step}",
        f"+callbacks.interrupt.batch={batch}",
        f"+callbacks.interrupt.how={how}",
        check=False,
    )
    assert stopped.returncode == STOPPED_EXIT_CODES[how], (stopped.stdout + stopped.stderr)[-3000:]


def losses_logged_since(folder: Path, events_before: set[Path]) -> list[tuple[int, float]]:
    """train/loss_step of the event files in `folder`/tensorboard not in `events_before`."""
    return [
        value
        for events in sorted(set((folder / "tensorboard").iterdir()) - events_before)
        for value in logged_scalars(events).get("train/loss_step", [])
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "how", "saved_at"),
    [([], "sigkill", 2), (DDP_TWO_RANKS, "sigterm", 3)],
    ids=["1-sigkill", "ddp2-sigterm"],
)
def test_a_run_stopped_mid_epoch_resumes_exactly(run_entry_point, ranks, how, saved_at):
    """The default model and loader (a worker, flips, variable sizes) over one epoch: killed
    at step 3, after the checkpoint at step 2, or stopped by SIGTERM to one ddp rank, which
    stops every rank before step 3 and saves there; resumed with ckpt_path=last, it logs the
    same loss at every step from there and ends with the same weights as the run that was
    never stopped. A validation runs after step 3's batch, as a signal in it would stop the run
    there (the resume logged every later step one too far)."""
    command = [
        *TINY_SHAPES,
        *ranks,
        "data.rows=4",
        "trainer.max_epochs=1",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=1",
        "callbacks.resume_checkpoint.every_n_train_steps=2",
        "callbacks.resume_checkpoint.train_time_interval=null",
        "test=false",  # the fit is what is compared (the README's ddp runs test after theirs)
        "patch_budgets=null",
    ]
    whole, stopped = run_entry_point.root / "whole", run_entry_point.root / "stopped"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    stop_at_step(run_entry_point, command, stopped, 3, how)
    assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == saved_at
    first_events = set((stopped / "tensorboard").iterdir())
    if not ranks:
        # on other ranks it is refused before they start (each refused it, and took it for a
        # crash at step 0), last.ckpt kept; other data or another network alike (test_sampler,
        # and check_resumable's test above)
        other = run_entry_point(
            "train.py", *command, *DDP_TWO_RANKS, f"hydra.run.dir={stopped}", "ckpt_path=last", check=False
        )
        errors = [line for line in (other.stdout + other.stderr).splitlines() if "error:" in line]
        refusal = f"stopped after batch {saved_at} of epoch 0 on 1 rank(s), this run has 2"
        assert other.returncode == 2 and len(errors) == 1 and refusal in errors[0], errors
        assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == saved_at
        first_events = set((stopped / "tensorboard").iterdir())
    run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
    assert_resumed_exactly(whole, stopped, first_events, saved_at)


@pytest.mark.slow
def test_a_run_stopped_after_a_step_and_before_its_batchs_end_resumes_exactly(run_entry_point):
    """(Ctrl-C or an error in the on_train_batch_end of an epoch's last step, no validation
    due, where the resume trained one step more: test_a_save_at_an_epochs_last_batch_...)
    In the validation after a step: the resume took that validation as run (none
    logged, its best checkpoint never written, an older one tested), and under callbacks=ema
    carried on from the average as the trained weights. Killed in that validation, after a
    periodic save at its step: the resume from that save skipped it alike."""
    command = [
        *TINY_SHAPES,
        "data.rows=4",
        "trainer.max_epochs=2",
        "trainer.check_val_every_n_epoch=2",
        "trainer.log_every_n_steps=1",
        "callbacks=ema",
        "test=false",  # the fit is what is compared
        "patch_budgets=null",
    ]
    whole = run_entry_point.root / "whole"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    expected = logged_scalars(whole / "tensorboard")
    steps = len(expected["train/loss_step"])
    in_validation = [
        f"+callbacks.interrupt.step={steps}",
        "+callbacks.interrupt.validation=true",
        "+callbacks.interrupt.batch=1",
    ]
    periodic_save = [
        f"callbacks.resume_checkpoint.every_n_train_steps={steps}",
        "callbacks.resume_checkpoint.train_time_interval=null",
    ]
    for name, where, settings, exit_code in (
        ("in_validation", in_validation, [], 1),
        (
            "killed_in_validation",
            [*in_validation, "+callbacks.interrupt.how=sigkill"],
            periodic_save,
            -signal.SIGKILL,
        ),
    ):
        stopped = run_entry_point.root / name
        interrupt = ["+callbacks.interrupt._target_=tests.interruptions.InterruptAfterStep", *where]
        result = run_entry_point(
            "train.py", *command, *settings, *interrupt, f"hydra.run.dir={stopped}", check=False
        )
        output = result.stdout + result.stderr
        assert result.returncode == exit_code and ("on purpose" in output) == (exit_code == 1), output[-3000:]
        saved_at = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        first_events = set((stopped / "tensorboard").iterdir())
        run_entry_point("train.py", *command, *settings, f"hydra.run.dir={stopped}", "ckpt_path=last")
        assert_resumed_exactly(whole, stopped, first_events, saved_at)
        resumed = {tag: [] for tag in expected}
        for events in sorted(set((stopped / "tensorboard").iterdir()) - first_events):
            for tag, values in logged_scalars(events).items():
                resumed.setdefault(tag, []).extend(values)
        assert resumed["val/acc"] == [
            (step, acc) for step, acc in expected["val/acc"] if step >= saved_at - 1
        ]


@pytest.mark.slow
def test_a_stop_in_an_epochs_last_validation_resumes_into_that_epoch_whatever_the_next_ones_length(
    run_entry_point,
):
    """At data.rows=2 the tiny set's epochs plan 15 and 16 batches. Stopped in the validation
    at an epoch's end, the resume ran it again and then trained the next epoch's first batch
    as that epoch's rest (the loader had moved on to the next plan), every later step
    shifted and other weights at the end; stopped in the last epoch's, it trained a batch past
    the run's end."""
    command = [*TINY_SHAPES, "data.rows=2", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"]
    command += ["test=false", "patch_budgets=null"]
    whole = run_entry_point.root / "whole"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    epoch_ends = [step + 1 for step, _ in logged_scalars(whole / "tensorboard")["train/loss_epoch"]]
    assert epoch_ends[0] != epoch_ends[1] - epoch_ends[0], epoch_ends  # epochs of other lengths
    for step in epoch_ends:
        stopped = run_entry_point.root / f"stopped_at_{step}"
        interrupt = ["+callbacks.interrupt._target_=tests.interruptions.InterruptAfterStep"]
        interrupt += [f"+callbacks.interrupt.step={step}", "+callbacks.interrupt.validation=true"]
        result = run_entry_point("train.py", *command, *interrupt, f"hydra.run.dir={stopped}", check=False)
        assert result.returncode == 1 and "on purpose" in result.stdout + result.stderr
        # its result so far in HPARAMS, not the placeholder (0.0): the best val/acc before it
        stopped_logs = logged_scalars(stopped / "tensorboard")
        best = max((acc for _, acc in stopped_logs.get("val/acc", [])), default=math.nan)
        assert stopped_logs["hp/val_acc"][-1][1] == pytest.approx(best, nan_ok=True)
        first_events = set((stopped / "tensorboard").iterdir())
        resumed = run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
        assert_resumed_exactly(whole, stopped, first_events, step)
        # Lightning's warning of a checkpoint folder that holds files: a resume's always does
        assert "exists and is not empty" not in resumed.stdout + resumed.stderr


@pytest.mark.slow
def test_a_save_at_an_epochs_last_batch_without_validation_resumes_with_the_next_epoch(run_entry_point):
    """No validation due there: Lightning's resume of the batch-end form counted the epoch as
    over and skipped as many batches of the next one as it had (1 of its 16 trained, then the
    run ended), its epoch count one short (a later resume trained one batch). A periodic save
    there was the run's last.ckpt for the whole next epoch: the epoch-end save was skipped
    as made at that step."""
    command = [*TINY_SHAPES, "data.rows=2", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"]
    command += ["trainer.check_val_every_n_epoch=2", "test=false", "patch_budgets=null"]
    whole = run_entry_point.root / "whole"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    epoch_ends = [step + 1 for step, _ in logged_scalars(whole / "tensorboard")["train/loss_epoch"]]
    assert epoch_ends[0] != epoch_ends[1] - epoch_ends[0], epoch_ends  # epochs of other lengths
    periodic_save_then_killed = [
        f"callbacks.resume_checkpoint.every_n_train_steps={epoch_ends[0]}",
        "callbacks.resume_checkpoint.train_time_interval=null",
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        f"+callbacks.interrupt.step={epoch_ends[0] + 5}",
        "+callbacks.interrupt.how=sigkill",
    ]
    error_after_the_batch = [
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAfterStep",
        f"+callbacks.interrupt.step={epoch_ends[0]}",
    ]
    for name, stop, exit_code in (
        ("killed", periodic_save_then_killed, -signal.SIGKILL),
        ("error", error_after_the_batch, 1),
    ):
        stopped = run_entry_point.root / name
        result = run_entry_point("train.py", *command, *stop, f"hydra.run.dir={stopped}", check=False)
        assert result.returncode == exit_code
        first_events = set((stopped / "tensorboard").iterdir())
        run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
        assert_resumed_exactly(whole, stopped, first_events, epoch_ends[0])
        ends = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (whole, stopped)]
        assert (
            ends[0]["loops"]["fit_loop"]["epoch_progress"] == ends[1]["loops"]["fit_loop"]["epoch_progress"]
        )


def assert_resumed_exactly(whole: Path, stopped: Path, first_events: set[Path], saved_at: int) -> None:
    """The run in `stopped`, resumed from step `saved_at`, logged the losses of the run never
    stopped, `whole`, at the same steps from there, and ended with the same weights."""
    resumed = losses_logged_since(stopped, first_events)
    expected = logged_scalars(whole / "tensorboard")["train/loss_step"]
    assert len(expected) >= 4 and resumed == [(step, loss) for step, loss in expected if step >= saved_at]
    ends = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (whole, stopped)]
    assert ends[0]["global_step"] == ends[1]["global_step"] == expected[-1][0] + 1
    assert ends[0]["state_dict"].keys() == ends[1]["state_dict"].keys()
    assert all(torch.equal(ends[0]["state_dict"][k], ends[1]["state_dict"][k]) for k in ends[0]["state_dict"])
    # A best checkpoint written again by the resume replaces the stopped run's: it was left
    # beside a -v1 copy, which the run then took for its best.
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == sorted(
        p.name for p in (whole / "checkpoints").iterdir()
    )


@pytest.mark.slow
def test_a_run_that_ended_within_an_epoch_resumes_exactly(run_entry_point):
    """trainer.max_steps=4 ends epoch 0 (8 batches) at its validation halfway: Lightning
    counted the epoch as over, and the same command with max_steps=12 trained its last 4
    batches as epoch 1, then stopped at max_epochs=2 at step 8 (an early stop at such a
    validation alike); kept from the validation's form, it logged each step one too high. A
    stop asked in epoch 1 (trainer.max_time's) was taken for that form: one too low. And
    max_steps=8 ends epoch 0 at its end: given max_steps, Lightning resumed the epoch's end
    as an epoch running, counted it twice, and trained nothing more. A periodic save at the
    validation's step, before it, must not be the run's last: its resume ran it again."""
    command = [*TINY_RUN, "trainer.max_epochs=2", "trainer.val_check_interval=0.5", "model.scheduler=null"]
    command += ["test=false", "patch_budgets=null", "trainer.max_steps=12"]
    command += [
        "callbacks.resume_checkpoint.every_n_train_steps=4",
        "callbacks.resume_checkpoint.train_time_interval=null",
    ]
    stop_asked = ["+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep"]
    stop_asked += ["+callbacks.interrupt.step=10", "+callbacks.interrupt.how=should_stop"]
    whole = run_entry_point.root / "whole"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    for first_run, saved_at in ((["trainer.max_steps=4"], 4), (stop_asked, 11), (["trainer.max_steps=8"], 8)):
        stopped = run_entry_point.root / f"stopped_at_{saved_at}"
        run_entry_point("train.py", *command, *first_run, f"hydra.run.dir={stopped}")
        first_events = set((stopped / "tensorboard").iterdir())
        run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
        assert_resumed_exactly(whole, stopped, first_events, saved_at)
        # the validations after it at the same steps (the stop asked for one of its own)
        validated = [
            [step for step, _ in logged_scalars(run / "tensorboard")["val/acc"]] for run in (whole, stopped)
        ]
        assert [step for step in validated[0] if step >= saved_at] == [
            s for s in validated[1] if s >= saved_at
        ]
        assert len(set(validated[1])) == len(validated[1]), validated[1]


def test_an_error_in_a_notebooks_fit_is_the_error_reported_with_the_save_it_left(
    project_root, tmp_path, caplog, recwarn
):
    """A config composed as notebooks/ composes it has no run folder of Hydra's (@hydra.main
    sets it): the line saying how to resume read it, and the notebook got
    MissingMandatoryValue (hydra.runtime.output_dir) over its own error, and no teardown.
    And the notebook sees none of the warnings train.py drops as asking nothing of the user."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*TINY_RUN, "logger=csv"], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
        cfg.paths.data_dir = str(project_root / "data")
        cfg.paths.output_dir = str(tmp_path / "run")
    datamodule, model, trainer = build(cfg, [InterruptAtStep(step=2, how="error")])
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="at step 2 on purpose"):
        trainer.fit(model, datamodule=datamodule)
    assert "stopped at step 2 (RuntimeError)" in caplog.text and "ckpt_path=last resumes" in caplog.text
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    shown = [str(warning.message) for warning in recwarn]
    assert not [
        message for message in shown if "LeafSpec" in message or "on_before_batch_transfer" in message
    ]


@pytest.mark.slow
def test_an_error_inside_an_accumulation_window_resumes_from_its_start(run_entry_point):
    """With trainer.accumulate_grad_batches=2 a step takes two batches, and no checkpoint
    holds the gradients of the first. An error at step 2's second batch saves last.ckpt as
    at that step's first batch: resumed, the run replays both (it stepped on the second
    alone) and logs each later step where the run never stopped does (one too far)."""
    command = [*TINY_RUN, "trainer.accumulate_grad_batches=2", "test=false", "patch_budgets=null"]
    whole, stopped = run_entry_point.root / "whole", run_entry_point.root / "stopped"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    stop_at_step(run_entry_point, command, stopped, 2, "error", batch=1)
    saved = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches_done"] == 4
    first_events = set((stopped / "tensorboard").iterdir())
    run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
    assert_resumed_exactly(whole, stopped, first_events, 2)


@pytest.mark.parametrize(("batches", "saved_after"), [(8, [2, 4, 6, 8]), (7, [2, 4, 6, 7])])
def test_periodic_saves_wait_for_the_end_of_an_accumulation_window(monkeypatch, batches, saved_after):
    """A save inside a window would resume without its first batches' gradients; the epoch's
    last window steps however short it is."""
    progress = _BatchProgress()
    no_validation = SimpleNamespace(
        batch_progress=progress, _should_check_val_fx=lambda fetcher: False, _batches_that_stepped=0
    )
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(
            epoch_loop=no_validation,
            _data_fetcher=None,
            epoch_progress=_Progress.from_defaults(_ProcessedTracker),
        ),
        num_training_batches=batches,
        accumulate_grad_batches=2,
        should_stop=False,
        _val_check_time_interval=None,
        global_step=0,
    )
    saved = []
    monkeypatch.setattr(
        ModelCheckpoint, "on_train_batch_end", lambda *args: saved.append(progress.current.processed)
    )
    resume = ResumeCheckpoint("unused", train_time_interval=1)
    for batch_idx in range(batches):
        progress.increment_ready()
        progress.increment_started()
        progress.increment_processed()
        resume.on_train_batch_end(trainer, None, None, None, batch_idx)
        progress.increment_completed()
    assert saved == saved_after


@pytest.mark.parametrize("timed", [False, True])
def test_a_save_before_a_due_validation_is_a_stop_at_its_start_unless_the_validation_is_timed(timed):
    """A resume runs such a stop's validation; a timed one it skips (its clock starts anew),
    and the form made it log every later step one too low."""
    batches, validations = _BatchProgress(), _BatchProgress()
    for batch in range(3):  # in the third batch's on_train_batch_end
        batches.increment_ready()
        batches.increment_started()
        batches.increment_processed()
        if batch < 2:
            batches.increment_completed()
    epoch_loop = SimpleNamespace(
        batch_progress=batches,
        val_loop=SimpleNamespace(batch_progress=validations),
        _should_check_val_fx=lambda fetcher: True,
    )
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=None),
        should_stop=False,
        _val_check_time_interval=60.0 if timed else None,
    )
    before = (batches.state_dict(), validations.state_dict())
    with saved_as_before_validation(trainer) as applied:
        saved = (batches.current.completed, validations.current.started, validations.current.completed)
    assert applied is not timed
    assert saved == ((2, 0, 0) if timed else (3, 1, 0))
    assert (batches.state_dict(), validations.state_dict()) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rows", "first_epoch", "saved_at"),
    [(4, 8, 10), (2, 15, 18)],
    ids=["equal-epochs", "a-longer-second-epoch"],
)
def test_a_run_killed_in_a_later_epoch_resumes_exactly(run_entry_point, rows, first_epoch, saved_at):
    """Lightning asks for the train loader at every epoch (trainer.reload_dataloaders_every_n_epochs):
    killed in epoch 1 after its checkpoint at step `saved_at`, the resumed run goes on from
    that batch of that epoch, with the losses of the run never stopped. With 2 rows the
    second epoch packs into 16 batches against the first's 15, and the resumed run took
    Lightning's estimate of its schedule's length from it: another cosine from there."""
    command = [
        *TINY_RUN,
        f"data.rows={rows}",
        "trainer.max_epochs=2",
        "test=false",
        "patch_budgets=null",
        "callbacks.resume_checkpoint.every_n_train_steps=2",
        "callbacks.resume_checkpoint.train_time_interval=null",
    ]
    whole, stopped = run_entry_point.root / "whole", run_entry_point.root / "stopped"
    run_entry_point("train.py", *command, f"hydra.run.dir={whole}")
    expected = logged_scalars(whole / "tensorboard")
    assert expected["train/loss_epoch"][0][0] == first_epoch - 1
    stop_at_step(run_entry_point, command, stopped, saved_at + 1)
    assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == saved_at
    first_events = set((stopped / "tensorboard").iterdir())
    run_entry_point("train.py", *command, f"hydra.run.dir={stopped}", "ckpt_path=last")
    resumed = losses_logged_since(stopped, first_events)
    assert resumed == [(step, loss) for step, loss in expected["train/loss_step"] if step >= saved_at]
    # the best accuracy over both epochs, not over the epoch after the resume
    resumed_best = [
        value
        for events in sorted(set((stopped / "tensorboard").iterdir()) - first_events)
        for value in logged_scalars(events).get("val/acc_best", [])
    ]
    assert resumed_best == expected["val/acc_best"][-1:]


@pytest.mark.slow
@pytest.mark.parametrize("ended", ["limit_train_batches", "stop_in_its_validation"])
def test_an_epoch_end_resume_with_another_batch_shape_goes_on_along_the_rest_of_its_schedule(
    run_entry_point, ended
):
    """Trained 5 batches of its first epoch's 8 (limit_train_batches), resumed at that epoch's
    end with half the rows, so more steps an epoch (as on fewer ranks), and one more epoch:
    the cosine runs from the saved step to the run's new end. Lightning's estimate, two
    epochs at the new count, put the end 10 steps late, and from twice the ranks before the
    saved step (the rate sat at its floor). Its first epoch ended 3 batches before its plan:
    read as mid-epoch, the resume was refused (other data.rows). Stopped in the epoch's
    validation instead, the resume runs it again: its loader keeps the epoch's length at the
    first run's rows, which the schedule took for the later epochs' (it ended at half)."""
    run = run_entry_point.root / "run"
    command = [*TINY_RUN, "test=false", "patch_budgets=null", f"hydra.run.dir={run}"]
    if ended == "limit_train_batches":
        run_entry_point("train.py", *command, "trainer.limit_train_batches=5")
    else:
        interrupt = ["+callbacks.interrupt._target_=tests.interruptions.InterruptAfterStep"]
        interrupt += ["+callbacks.interrupt.step=8", "+callbacks.interrupt.validation=true"]
        run_entry_point("train.py", *command, *interrupt, check=False)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == (5 if ended == "limit_train_batches" else 8)
    run_entry_point("train.py", *command, "ckpt_path=last", "trainer.max_epochs=2", "data.rows=2")
    rates = logged_scalars(run / "tensorboard")["lr-AdamW/pg1"]
    resumed = [(step, rate) for step, rate in rates if step >= saved["global_step"]]
    total = resumed[-1][0] + 1
    assert len(resumed) > saved["global_step"] + 4  # more steps an epoch than the first
    config = OmegaConf.load(run / ".hydra" / "config.yaml")
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=saved["lr_schedulers"][0]["base_lrs"][0])
    schedule = hydra.utils.instantiate(config.model.scheduler)(optimizer, total)
    expected = []
    for _ in range(total):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [rate for _, rate in resumed] == pytest.approx(expected[saved["global_step"] :], rel=1e-5)


def stopped_trainer(fn: TrainerFn, validating: bool, global_step: int = 0) -> SimpleNamespace:
    """What ResumeCheckpoint.on_exception reads of a one-process Trainer running `fn`."""
    return SimpleNamespace(
        world_size=1,
        global_step=global_step,
        validating=validating,
        sanity_checking=False,
        fast_dev_run=False,
        state=SimpleNamespace(fn=fn),
    )


def test_a_stop_before_this_processs_first_batch_saves_nothing_and_claims_no_save(monkeypatch, caplog):
    """A resume refused at its start (its data changed since a mid-epoch save) said "stopped at
    step 0: saved last.ckpt": the checkpoint's callback state names last.ckpt, and Lightning's
    count of the step last saved starts at 0. Nothing was written. A resume that Lightning
    refused while restoring its loops (trainer.max_epochs below the checkpoint's epoch) wrote
    last.ckpt back at its step without its optimizer and schedule states."""
    resume = ResumeCheckpoint("unused")
    resume.last_model_path = "run/checkpoints/last.ckpt"  # as the resumed checkpoint restores it
    saved = []
    monkeypatch.setattr(ResumeCheckpoint, "_should_save_on_exception", lambda self, trainer: True)
    monkeypatch.setattr(ResumeCheckpoint, "_save_last_checkpoint", lambda self, *args: saved.append(args))
    trainer = stopped_trainer(TrainerFn.FITTING, validating=False)
    with caplog.at_level(logging.INFO):
        resume.on_exception(trainer, None, DataError("the checkpoint stopped after batch 6 of epoch 0, ..."))
        trainer.global_step = 24  # restored, the optimizer not yet
        resume.on_exception(trainer, None, ValueError("You restored a checkpoint with current_epoch=2"))
    assert "saved" not in caplog.text and saved == []
    monkeypatch.setattr(ResumeCheckpoint, "_should_save_on_exception", lambda self, trainer: False)
    resume.on_train_batch_start(trainer, None)
    trainer.global_step = resume._last_global_step_saved = 8  # an epoch's end saved, then a signal
    with caplog.at_level(logging.INFO):
        resume.on_exception(trainer, None, KeyboardInterrupt())
    assert "stopped at step 8 (KeyboardInterrupt): saved run/checkpoints/last.ckpt" in caplog.text


def test_a_stop_in_a_validation_after_the_fit_leaves_the_fits_last_checkpoint(monkeypatch):
    """train.py's budget sweep validates the best checkpoint's weights after the fit: a Ctrl-C
    or an error there wrote them into last.ckpt at the fit's last step, and ckpt_path=last
    went on from the best epoch's weights with the last one's step and optimizer."""
    resume = ResumeCheckpoint("unused")
    resume.trained_here = True
    saved = []
    monkeypatch.setattr(ResumeCheckpoint, "_save_last_checkpoint", lambda self, *args: saved.append(args))
    trainer = stopped_trainer(TrainerFn.VALIDATING, validating=True, global_step=24)
    monkeypatch.setattr(ResumeCheckpoint, "_should_save_on_exception", lambda self, trainer: True)
    resume.on_exception(trainer, None, KeyboardInterrupt())
    assert saved == []


class ScriptedValAcc(BoringModel):
    """val/acc 0.9 and 0.5 at the first epoch's two validations, 0.6 and 0.7 at the second's."""

    scores = (0.9, 0.5, 0.6, 0.7)

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", self.scores[self.validations])

    def on_validation_epoch_end(self) -> None:
        self.validations += 1


@pytest.mark.parametrize(
    "timing", [{"every_n_train_steps": 3}, {"train_time_interval": timedelta(seconds=60)}]
)
def test_a_best_checkpoint_saved_between_validations_is_refused(timing):
    """Lightning then saves at training steps alone, each scored with the last validation's
    value: the run tested a step's weights as the best, scored with older ones' val/acc."""
    key = next(iter(timing))
    with pytest.raises(ConfigError, match=f"callbacks.model_checkpoint.{key} saves between validations"):
        BestCheckpoint(monitor="val/acc", mode="max", **timing)
    BestCheckpoint(**timing)  # nothing monitored: a save of the weights as they are


def test_a_best_checkpoint_is_kept_through_two_validations_an_epoch_under_save_top_k(tmp_path):
    """Without versions (enable_version_counter=false, which a resume's stale best asked
    for) the 0.5 overwrote the 0.9 under epoch_000.ckpt, and top-k then deleted the file."""
    best = BestCheckpoint(
        dirpath=tmp_path, filename="epoch_{epoch:03d}", monitor="val/acc", mode="max", save_top_k=2,
        auto_insert_metric_name=False,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, max_epochs=2,
        limit_train_batches=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=[best],
    )  # fmt: skip
    trainer.fit(ScriptedValAcc())
    assert float(best.best_model_score) == pytest.approx(0.9)
    kept = {Path(path).name: float(score) for path, score in best.best_k_models.items()}
    assert kept == pytest.approx({"epoch_000.ckpt": 0.9, "epoch_001.ckpt": 0.7})
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(kept)


def test_a_best_checkpoint_takes_a_version_only_against_the_ones_it_keeps(tmp_path):
    """A stopped run's file of that name, which a resume's callback does not keep, is
    written over: Lightning wrote a -v1 beside it, and the run took the -v1 for its best."""
    best = BestCheckpoint(
        dirpath=tmp_path,
        filename="epoch_{epoch:03d}",
        monitor="val/acc",
        save_top_k=2,
        auto_insert_metric_name=False,
    )
    candidates = {"epoch": torch.tensor(0), "step": torch.tensor(3), "val/acc": torch.tensor(0.5)}
    first = str(tmp_path / "epoch_000.ckpt")
    Path(first).touch()
    assert best._get_metric_interpolated_filepath_name(candidates, None) == first
    best.best_k_models[first] = torch.tensor(0.9)
    assert best._get_metric_interpolated_filepath_name(candidates, None) == str(
        tmp_path / "epoch_000-v1.ckpt"
    )
    assert best._get_metric_interpolated_filepath_name(candidates, None, del_filepath=first) == first
