"""Benchmark commands; each composes train.py's config as train.py would."""

from __future__ import annotations

import argparse

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from navit_lightning import CONFIG_DIR, default_project_root


def train_config(overrides: list[str]) -> DictConfig:
    """train.py's config with `overrides`, its paths where train.py's would be."""
    default_project_root()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)


def at_least_one(text: str) -> int:
    """argparse's type for a flag that counts steps, images or rounds: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:  # not argparse's "invalid at_least_one value" line
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a whole number, 1 or more")
    return value
