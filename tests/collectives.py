"""Callbacks that break the collective rules, or fail, on purpose, for the tests of what follows."""

import lightning as L
import torch


class ReduceAtTrainEpochEnd(L.Callback):
    """The mistake utils/callbacks.py describes: every rank reduces in on_train_epoch_end,
    where rank 0's progress bar has already started syncing the epoch's metrics."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"rank {trainer.global_rank}: reducing in on_train_epoch_end", flush=True)
        trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")


class FailAtTrainStart(L.Callback):
    """A bug of the user's own code, not bad input: its traceback must reach the job's log."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise ZeroDivisionError("a callback of the user's own failed")
