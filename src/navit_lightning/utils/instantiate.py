"""Hydra configs: Lightning objects built from their groups, and their settings read as
dotted keys."""

from __future__ import annotations

import inspect
import os
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from omegaconf import DictConfig

from navit_lightning.errors import ConfigError

# The Trainer flags that switch a kind of callback off, and the kind
SWITCHES = {
    "enable_checkpointing": ModelCheckpoint,
    "enable_progress_bar": ProgressBar,
    "enable_model_summary": ModelSummary,
}


def instantiate_datamodule(data: DictConfig) -> L.LightningDataModule:
    """The datamodule `data` describes. One of the user's own must give what the entry points
    read of it besides Lightning's hooks: without it, a traceback where it was first read."""
    datamodule = hydra.utils.instantiate(data)
    # looked up, not read: the project's num_classes lists the data folder, which predict.py
    # does without (a checkpoint's training data need not be on the machine)
    if missing := [name for name in ("num_classes", "class_names") if not has_attribute(datamodule, name)]:
        raise ConfigError(
            f"data._target_={data._target_} has no {' or '.join(missing)}: a datamodule gives the "
            "number of classes (num_classes) and their names (class_names(), a list), as "
            "navit_lightning.data.datamodule.PackedImageDataModule does"
        )
    return datamodule


def has_attribute(instance: object, name: str) -> bool:
    """hasattr without running a property or a __getattr__."""
    try:
        inspect.getattr_static(instance, name)
    except AttributeError:
        return False
    return True


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group such as callbacks or logger."""
    if not group:
        return []
    return [hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry]


def switched_on(trainer: DictConfig, callbacks: list[Any]) -> list[Any]:
    """`callbacks` but those of a kind that a Trainer flag set to false switches off:
    Lightning refused trainer.enable_checkpointing=false or enable_progress_bar=false beside
    the default callbacks' checkpoints and progress bar, and printed the model summary under
    enable_model_summary=false."""
    off = tuple(kind for flag, kind in SWITCHES.items() if trainer.get(flag) is False)
    return [callback for callback in callbacks if not isinstance(callback, off)]


def dotted_settings(node: dict | list, prefix: str = "") -> dict[str, Any]:
    """A config as a container -> its leaf values by dotted key ("model.net.dim"; a list's
    items by index, "tags.0")."""
    flat = {}
    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
        if isinstance(value, (dict, list)):
            flat.update(dotted_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def absolute_path(path: object) -> str:
    """`path`, `~` expanded, from the folder the command ran in, also where Hydra changed into
    the run's folder (hydra.job.chdir=true); a URL (s3://...) as it is. Hydra reads a folder
    named 2024 as a number."""
    text = str(path)
    return text if "://" in text else os.path.normpath(hydra.utils.to_absolute_path(os.path.expanduser(text)))
