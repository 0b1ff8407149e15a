"""Building Lightning objects from Hydra config groups."""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group such as callbacks or logger."""
    if not group:
        return []
    return [hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry]
