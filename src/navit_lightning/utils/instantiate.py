"""Building Lightning objects from Hydra config groups."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hydra
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from navit_lightning.data.folder import DataError
from navit_lightning.utils.validate import ConfigError


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a group such as callbacks or logger."""
    if not group:
        return []
    return [hydra.utils.instantiate(entry) for entry in group.values() if entry and "_target_" in entry]


def log_config(config: DictConfig) -> None:
    rank_zero_info("Config:\n" + OmegaConf.to_yaml(config, resolve=True))


def route_lightning_logs_to_hydra() -> None:
    """Lightning gives its loggers their own console handler at import time, before Hydra
    configures logging, and stops them propagating: hand their records to the root logger
    instead, so that they reach Hydra's console and the run's log file once."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


@contextmanager
def refuse_bad_input() -> Iterator[None]:
    """Turn a DataError (bad data.root, a class folder without images, ...) or a ConfigError
    (a GPU-only setting on CPU, ...) into one line on the console and exit code 2, instead
    of a traceback."""
    try:
        yield
    except (DataError, ConfigError) as error:
        logging.getLogger("navit_lightning").error("error: %s", error)
        raise SystemExit(2) from None
