"""What eval.py and predict.py rebuild from a training run's checkpoint: its data, with what
their command line gives laid over it, its network, and a trainer that writes no checkpoints."""

from __future__ import annotations

from collections.abc import Collection
from importlib import import_module
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from navit_lightning.errors import ConfigError, is_count
from navit_lightning.utils.instantiate import absolute_path, instantiate_datamodule, switched_on
from navit_lightning.utils.loggers import instantiate_loggers

# What a data group given to eval.py or predict.py decides: where the images come from. The
# network was trained on the run's image sizes, batch shape and split, which its defaults
# would replace (imagefolder's data.max_patches=36 for a run trained at 144).
SOURCE_SETTINGS = ("_target_", "root", "shards", "generate", "index_dir")


# The model settings eval.py and predict.py take from the command line: how the network
# computes, not what it is (+model.net.attention=sdpa). Any other would be left out, as
# +model.net.depth=3 was, without a word.
RUNTIME_MODEL_SETTINGS = {"net.attention"}


def data_for(cfg: DictConfig, run: DictConfig, given: Collection[str] = ()) -> DictConfig:
    """eval.py's and predict.py's data: the training run's, with the data.* settings `given`
    on the command line laid over it (data.rows=4, +data.max_images_per_row=8), and with a
    data group chosen there (data=imagefolder data.root=...) its source too. A group of
    another datamodule class, neither derived from the other, is taken as it is."""
    data = cfg.get("data") or {}
    group = "_target_" in data
    derived = derived_target(data._target_, run.data.get("_target_")) if group else None
    if group and derived is None:
        return data
    if group:  # its source, and what the command line set; unresolved (data.patch_size=${model...})
        chosen = OmegaConf.masked_copy(data, [key for key in data if key in SOURCE_SETTINGS or key in given])
    else:  # eval.yaml's and predict.yaml's data.* settings are null unless given
        chosen = {key: value for key, value in data.items() if value is not None}
    merged = OmegaConf.merge(run.data, chosen)
    if group:  # the run's own datamodule, derived from the group's, takes the run's settings
        merged._target_ = derived
    lengthened = "max_patches" in chosen and "row_len" not in chosen
    if lengthened and is_count(merged.max_patches) and merged.max_patches > merged.row_len:
        # an evaluation's rows hold one image at any size (the datamodule lengthens them); a
        # max_patches past row_len is refused of the training rows
        merged.row_len = merged.max_patches
    if "root" in chosen:  # resolved where the command's config can (data.root=${paths.data_dir}/x)
        merged.root = absolute_path(data.root)
        if not same_folder(merged.root, run.data.root) and "evaluate_all" not in given:
            # taken for a folder the run did not train on: all its images are evaluated, none
            # held out. A copy or shards of the run's folder, given evaluate_all=false, hold out
            # the run's split (drawn from the images' paths within it).
            merged.evaluate_all = True
    return merged


def derived_target(one: str, other: str | None) -> str | None:
    """Of two _target_s, the one that derives from the other (a run trained on a datamodule of
    one's own, derived from the project's, evaluated on data=imagefolder); None where
    neither does."""
    if one == other:
        return one
    try:
        first, second = (
            getattr(import_module(module), name)
            for module, _, name in (str(target).rpartition(".") for target in (one, other))
        )
    except (ImportError, AttributeError, ValueError):
        return None
    if not (isinstance(first, type) and isinstance(second, type)):  # a factory function's
        return None
    return one if issubclass(first, second) else other if issubclass(second, first) else None


def same_folder(one: str, other: str) -> bool:
    """By device and inode where both exist: a bind mount or a second NFS mount of the run's
    folder is the run's folder under another path."""
    one_path, other_path = Path(one).expanduser(), Path(other).expanduser()
    if one_path.exists() and other_path.exists():
        return one_path.samefile(other_path)
    return one_path.resolve() == other_path.resolve()


def keys_given(group: str) -> set[str]:
    """What the command line of this Hydra job sets in `group`, as dotted keys below it
    (data.rows=4, +data.generate.seed=1: rows, generate.seed; data=imagefolder: "")."""
    if not HydraConfig.initialized():
        return set()
    keys = (override.split("=", 1)[0].lstrip("+~") for override in HydraConfig.get().overrides.task)
    return {key.removeprefix(group).removeprefix(".") for key in keys if key.split(".")[0] == group}


def data_keys_given() -> set[str]:
    """The data.* keys the command line of this Hydra job sets (data.rows=4, +data.x=1), and
    those its configs/local file sets (README: they apply to eval.py and predict.py too)."""
    return {key.split(".")[0] for key in keys_given("data") if key} | set(local_settings().get("data") or {})


def local_settings() -> DictConfig:
    """What this Hydra job's configs/local file sets (the first found in its config folders, as
    Hydra finds it), or nothing: most machines have none. Read, not composed: the file is the
    config's root whatever its header, and its defaults list overrides the job's groups."""
    choice = HydraConfig.get().runtime.choices.get("local@_global_") if HydraConfig.initialized() else None
    for source in HydraConfig.get().runtime.config_sources if choice else []:
        path = Path(source.path.removeprefix("file://"), "local", f"{choice}.yaml")
        if source.schema == "file" and path.is_file():
            return OmegaConf.load(path)
    return OmegaConf.create()


def build_from_checkpoint(
    cfg: DictConfig, run: DictConfig, data: DictConfig, callbacks: list[L.Callback] | None = None
) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """For eval.py and predict.py: `data`'s datamodule, the network of the training config
    `run` (the weights come from cfg.ckpt_path when the trainer runs), and a trainer of
    cfg.trainer with cfg's loggers and `callbacks` that writes no checkpoints."""
    given = keys_given("model")
    if refused := sorted(given - RUNTIME_MODEL_SETTINGS):
        named = ", ".join(f"model.{key}" if key else "model" for key in refused)
        raise ConfigError(
            f"{named} given: eval.py and predict.py build the network the checkpoint holds, as it "
            f"trained; of the model settings only {', '.join(sorted(RUNTIME_MODEL_SETTINGS))} may be given"
        )
    with open_dict(cfg):  # the network must match the weights; data=... refers to it
        cfg.model = OmegaConf.merge(run.model, cfg.model) if given else run.model
    patch_size = cfg.model.net.patch_size
    if data.get("patch_size", patch_size) != patch_size:
        raise ConfigError(
            f"data.patch_size={data.patch_size} given: the checkpoint's network takes patches of "
            f"{patch_size} px (model.net.patch_size); leave data.patch_size out"
        )
    datamodule = instantiate_datamodule(data)
    model = hydra.utils.instantiate(cfg.model)
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        logger=instantiate_loggers(cfg.get("logger")) or False,
        callbacks=switched_on(cfg.trainer, callbacks or []),
        enable_checkpointing=False,  # else Lightning adds a ModelCheckpoint of its own
    )
    return datamodule, model, trainer
