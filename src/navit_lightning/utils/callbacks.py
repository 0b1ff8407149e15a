"""Callbacks that the Hydra entry points add themselves."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info


class StoreRunConfig(L.Callback):
    """Keeps the run's resolved config in every checkpoint, so that eval.py can rebuild the
    network from the checkpoint alone."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.config


class RankStepReport(L.Callback):
    """At the end of fit, rank zero reports how many training batches every rank ran: under
    DDP they must all be equal, or the ranks have drifted apart."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = trainer.strategy.all_gather(torch.tensor(self.batches, device=pl_module.device))
        rank_zero_info(
            f"training batches per rank: {counts.reshape(-1).tolist()} (world size {trainer.world_size})"
        )
