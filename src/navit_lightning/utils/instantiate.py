"""Building Lightning objects from Hydra config groups."""

from __future__ import annotations

from typing import Any

import hydra
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group such as callbacks or logger."""
    if not group:
        return []
    return [hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry]


def log_config(config: DictConfig) -> None:
    rank_zero_info("Config:\n" + OmegaConf.to_yaml(config, resolve=True))
