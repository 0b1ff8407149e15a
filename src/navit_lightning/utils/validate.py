"""Checks of the composed config that refuse, before any process starts, what would
otherwise fail deep inside Lightning or torch (or silently do something else)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

GPU_ACCELERATORS = {"gpu", "cuda"}
# Lightning turns 16-mixed into bf16-mixed on CPU with only a warning.
GPU_ONLY_PRECISIONS = {"16-mixed", "16"}


class ConfigError(ValueError):
    """The config asks for something this machine cannot do; the message says what to use."""


def check_launch(cfg: DictConfig) -> None:
    trainer = cfg.trainer
    gpus = torch.cuda.device_count()
    accelerator = str(trainer.accelerator)
    if accelerator in GPU_ACCELERATORS and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use trainer.accelerator=cpu"
        )
    on_gpu = accelerator in GPU_ACCELERATORS or (accelerator == "auto" and gpus > 0)
    devices = trainer.devices
    if on_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(
            f"trainer.devices={devices} but {gpus} CUDA GPU(s) are visible: "
            f"use trainer.devices={gpus} (or -1 for all of them)"
        )
    if not on_gpu and str(trainer.precision) in GPU_ONLY_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={trainer.precision} needs a CUDA GPU: on CPU use trainer.precision=bf16-mixed"
        )
    if not on_gpu and trainer.sync_batchnorm:
        raise ConfigError(
            "trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm runs on GPU only): "
            "drop it on CPU, where ddp ranks keep their own BatchNorm statistics"
        )
