"""Every config file composes, and what it describes instantiates."""

import re
import shutil
from pathlib import Path

import hydra
import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from omegaconf import open_dict

from navit_lightning import CONFIG_DIR
from navit_lightning.data.shards import write_shards
from navit_lightning.utils.instantiate import instantiate_group, switched_on
from tests.conftest import TINY_SET, TINY_SHAPES

GROUPS = [
    "data",
    "model",
    "optimizer",
    "scheduler",
    "strategy",
    "trainer",
    "callbacks",
    "logger",
    "experiment",
    "debug",
    "hparams_search",
]
OPTIONS = [
    f"{group}={path.stem}" for group in GROUPS for path in sorted((Path(CONFIG_DIR) / group).glob("*.yaml"))
]
# Options whose package comes with an extra (pip install -e ".[loggers]"): skipped without it.
NEEDS_PACKAGE = {"logger=mlflow": "mlflow", "logger=wandb": "wandb"}


def compose_train(overrides: list[str], tmp_path: Path, project_root: Path):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)  # as a run's: its log file goes there
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        cfg.paths.data_dir = str(project_root / "data")
        # what loggers share across runs (logger=mlflow's database) stays out of the checkout
        cfg.paths.log_dir = str(tmp_path / "logs")
    return cfg


def test_every_group_option_is_listed():
    assert {option.split("=")[0] for option in OPTIONS} == set(GROUPS)
    assert "strategy=ddp_spawn" in OPTIONS and "model=navit_base" in OPTIONS


def test_each_built_in_set_has_a_folder_of_its_own(tmp_path, project_root):
    """Other data.generate settings were written over data/shapes, under any run reading it."""

    def root(*overrides: str) -> Path:
        return Path(compose_train(list(overrides), tmp_path, project_root).data.root)

    assert root() == root("data.generate.max_aspect=2") == project_root / "data" / "shapes"
    assert root(*TINY_SHAPES) == project_root / TINY_SET  # where the tiny set is made for every test
    others = {root(*TINY_SHAPES, "data.generate.seed=1"), root("data.generate.max_aspect=3")}
    assert len({root(), root(*TINY_SHAPES), *others}) == 4


@pytest.mark.parametrize("option", OPTIONS)
def test_option_composes_and_instantiates(option, tmp_path, project_root):
    if option in NEEDS_PACKAGE:
        pytest.importorskip(NEEDS_PACKAGE[option])
    overrides = [option]
    if option == "data=imagefolder":
        overrides.append(f"data.root={project_root / TINY_SET}")
    if option == "data=shards":
        write_shards(project_root / TINY_SET, tmp_path / "shards")
        overrides.append(f"data.root={tmp_path / 'shards'}")
    cfg = compose_train(overrides, tmp_path, project_root)
    datamodule = hydra.utils.instantiate(cfg.data)
    assert isinstance(datamodule, L.LightningDataModule)
    with open_dict(cfg):
        cfg.model.num_classes = datamodule.num_classes
    model = hydra.utils.instantiate(cfg.model)
    assert isinstance(model, L.LightningModule)
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=instantiate_group(cfg.get("callbacks")),
        logger=instantiate_group(cfg.get("logger")) or False,
    )
    assert isinstance(trainer, L.Trainer)


def test_a_trainer_flag_set_to_false_switches_its_kind_of_callback_off(tmp_path, project_root):
    """Lightning refused trainer.enable_checkpointing=false (enable_progress_bar=false) beside
    the default callbacks' checkpoints (progress bar), and printed the model summary under
    enable_model_summary=false."""
    flags = ["enable_checkpointing", "enable_progress_bar", "enable_model_summary"]
    cfg = compose_train([f"++trainer.{flag}=false" for flag in flags], tmp_path, project_root)
    callbacks = instantiate_group(cfg.callbacks)
    kept = switched_on(cfg.trainer, callbacks)
    switched = (ModelCheckpoint, ProgressBar, ModelSummary)
    assert len(kept) < len(callbacks) and not any(isinstance(callback, switched) for callback in kept)
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=kept, logger=False)
    assert trainer.checkpoint_callback is None and trainer.progress_bar_callback is None
    assert switched_on(compose_train([], tmp_path, project_root).trainer, callbacks) == callbacks


def test_eval_config_composes(tmp_path):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=["ckpt_path=x.ckpt"])
    assert cfg.split == "test" and cfg.ckpt_path == "x.ckpt"


@pytest.mark.parametrize("task", ["eval", "predict"])
def test_eval_and_predict_help_name_the_groups_their_config_composes(task):
    """Hydra's --help listed every folder of configs/: debug=limit, model=... and logger=csv
    (predict.py) failed there with Hydra's "Could not override"."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(task, overrides=["ckpt_path=x.ckpt"], return_hydra_config=True)
        choices = cfg.hydra.runtime.choices
    composed = {group for group in choices if not group.startswith(("hydra", "local")) and "/" not in group}
    named = re.search(r"composes these \(group=option\): ([\w, ]+);", cfg.hydra.help.template)
    assert named and set(named.group(1).split(", ")) == composed


@pytest.mark.parametrize("task", ["train", "eval", "predict"])
def test_local_settings_apply_as_top_level_keys_under_the_debug_presets(task, tmp_path):
    """configs/local/default.yaml as the README shows it, without a package header: its keys
    went under `local:` and changed nothing; and a local trainer.max_epochs undid debug=limit."""
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    (configs / "local" / "default.yaml").write_text("trainer:\n  max_epochs: 20\n  devices: 3\n")
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(task)
        assert "local" not in cfg and cfg.trainer.devices == 3
        if task == "train":
            assert cfg.trainer.max_epochs == 20
            assert compose(task, overrides=["debug=limit"]).trainer.max_epochs == 2
