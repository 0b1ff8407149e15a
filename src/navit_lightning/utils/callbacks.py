"""Callbacks that the Hydra entry points add themselves."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


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


class UnreadableImageReport(L.Callback):
    """At the end of every epoch, counts the images that failed to decode on all ranks (each
    was named in a warning when it first failed), logs `<stage>/unreadable_images` and warns
    when there were any."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module, "train")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module, "test")

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dataset = getattr(trainer.datamodule, "datasets", {}).get(stage)
        if dataset is None:
            return
        counter = dataset.unreadable_this_epoch
        with counter.get_lock():
            count, counter.value = counter.value, 0
        if trainer.sanity_checking:
            return
        total = int(trainer.strategy.reduce(torch.tensor(count, device=pl_module.device), reduce_op="sum"))
        pl_module.log(f"{stage}/unreadable_images", float(total), on_epoch=True, rank_zero_only=True)
        if total:
            rank_zero_warn(
                f"{stage} epoch {trainer.current_epoch}: skipped {total} images that could not be decoded"
            )
