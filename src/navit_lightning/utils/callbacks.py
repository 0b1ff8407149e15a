"""The project's own callbacks: most of those configs/callbacks/ names (the checkpoint ones are
in utils/checkpoints.py, LogPictures in pictures.py), StoreRunConfig, which train.py adds, and
UnreadableImageReport, which eval.py adds too."""

from __future__ import annotations

import itertools
import logging
from functools import partial
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, ThroughputMonitor, WeightAveraging
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from navit_lightning.errors import ConfigError, DataError, is_whole
from navit_lightning.utils.host_memory import keep_freed_memory
from navit_lightning.utils.launch import resume_overrides

log = logging.getLogger(__name__)


class StoreRunConfig(L.Callback):
    """Keeps the run's resolved config and its class names (in label order) in every
    checkpoint, so that eval.py and predict.py can rebuild the network from the checkpoint
    alone and name what it predicts."""

    def __init__(self, config: dict[str, Any], class_names: list[str]) -> None:
        self.config = config
        self.class_names = class_names

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.config
        checkpoint["class_names"] = self.class_names


class KeepFreedHostMemory(L.Callback):
    """Where the model runs on the CPU, its freed activations stay in the heap for the next
    step (utils/host_memory.py): 3..7 % of a CPU step of 4,000 tokens. In setup, which every
    process of every strategy runs (ddp_spawn's children too)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.strategy.root_device.type == "cpu":
            keep_freed_memory()


def ema_update(weight: float, averages: list[torch.Tensor], currents: list[torch.Tensor], _: Any) -> None:
    """average += weight * (current - average), over a group of tensors of one dtype and device
    (AveragedModel's multi_avg_fn). Integer buffers (BatchNorm's batch count) take the current
    value. The averages keep the dtype the model had before the precision plugin converted it
    (WeightAveraging copies it first): under bf16-true or 64-true the current weights are cast
    to it, where lerp refused mixed dtypes at the first step."""
    if averages[0].is_floating_point():
        if currents[0].dtype != averages[0].dtype:
            currents = [current.to(averages[0].dtype) for current in currents]
        torch._foreach_lerp_(averages, currents, weight)
    else:
        torch._foreach_copy_(averages, currents)


class EMAWeights(WeightAveraging):
    """An exponential moving average of the weights (and buffers), updated after every
    optimizer step, used by fit's validations and written as every checkpoint's state_dict
    (the trained weights beside it, for a resume): eval.py, predict.py and init_from take the
    average. Unlike Lightning's EMAWeightAveraging:
    - it acts in fit only. After fit, train.py tests and sweeps the patch budgets on the best
      checkpoint, where Lightning's callback loaded that checkpoint's trained weights in place
      of its average and swapped its last average in for each budget's validation: here those
      figures are the checkpoint's, as eval.py gives them;
    - it pickles (a partial, not a closure), as ddp_spawn needs;
    - one foreach lerp a step, not a new tensor per parameter."""

    def __init__(self, decay: float = 0.995) -> None:
        if not 0 <= decay < 1:
            raise ConfigError(f"callbacks.ema.decay={decay} must be in [0, 1): e.g. 0.995")
        super().__init__(multi_avg_fn=partial(ema_update, 1 - decay))
        self.average_in_model = False  # between a fit validation's start and end
        self._trained: list[torch.Tensor] | None = None  # the trained weights, meanwhile

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_validation_epoch_start(trainer, pl_module)
            self.average_in_model = self._average_model is not None

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_validation_epoch_end(trainer, pl_module)
            self.average_in_model = False

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # A stop inside a validation: the save on it (ResumeCheckpoint, after this callback)
        # would store the average as the trained weights and the trained ones as the average.
        if self.average_in_model:
            self._swap_models(pl_module)
            self.average_in_model = False

    def _swap_models(self, pl_module: L.LightningModule) -> None:
        # Into a validation and back. Lightning swaps the two through each other's tensors:
        # where their dtypes differ (the average keeps float32 under bf16-true and 64-true, see
        # ema_update) every validation rounded the trained weights (64-true) or the average
        # (bf16-true). The trained weights wait aside instead, as they are.
        currents = list(itertools.chain(pl_module.parameters(), pl_module.buffers()))
        if self._trained is None:
            self._trained = [current.detach().clone() for current in currents]
            average = self._average_model.module
            averages = itertools.chain(average.parameters(), average.buffers())
            for current, averaged in zip(currents, averages, strict=True):
                current.data.copy_(averaged.data)
        else:
            for current, trained in zip(currents, self._trained, strict=True):
                current.data.copy_(trained)
            self._trained = None


class PackedThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor (images/s, real tokens/s, model FLOP/s) fed the counts
    the module took on the host (`pl_module.batch_counts`): counting images and tokens in the
    device batch would cost two device syncs a step. Lightning's own synchronize per batch
    stays: its clock needs it (cost measured in docs/benchmarks.md)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=self._images, length_fn=self._real_tokens, **kwargs)
        self._module: L.LightningModule | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._module = pl_module

    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, iter_num: int) -> None:
        # A batch without an image (each of its files undecodable, a rank's filler) would
        # leave fewer images than batches, which Lightning's Throughput refuses mid-run.
        if self._module.batch_counts.images:
            super()._update(trainer, pl_module, batch, iter_num)

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        # Training's figures only: Lightning logs an evaluation's at its own batch number, so
        # each validation drew over the last at steps 1, 2, ... of the training step axis. An
        # evaluation's time is still measured, and kept out of the training figures.
        stage = trainer.state.stage
        if stage == RunningStage.TRAINING and self._batches.get(stage):  # none yet: nothing to compute
            super()._compute(trainer, iter_num)

    def _images(self, batch: Any) -> int:
        return self._module.batch_counts.images

    def _real_tokens(self, batch: Any) -> int:
        return self._module.batch_counts.real_tokens


# Collectives and Lightning's rank-zero-only callbacks. The progress bar (rank 0 only) reads
# the logged metrics in its batch- and epoch-end hooks, which computes, and so syncs across
# ranks, every torchmetrics state and sync_dist value right there, on rank 0 alone; the
# other ranks do the same syncs later, in the same order, when Lightning collects the epoch's
# metrics. A collective of ours in those hooks would meet a different one on rank 0, and the
# run would hang (it did: UnreadableImageReport reduced its count in on_train_epoch_end).
# So: counts across ranks go through `pl_module.log(..., sync_dist=True, reduce_fx=...)`
# from batch hooks, and Lightning orders their reduction with the others; a collective of
# our own runs only where no epoch metric is left to compute (on_train_epoch_start for the
# epoch before, on_train_end).


class RankStepReport(L.Callback):
    """At the end of fit, rank zero reports how many training batches every rank ran: under
    DDP they must all be equal, or the ranks have drifted apart. Its all_reduce runs in
    on_train_end, when every rank has computed and synced all of the epoch's metrics."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.batches = 0  # a notebook's second fit of the trainer: its own batches alone

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each rank's count in its own place, summed: a gather, without Lightning's all_gather,
        # which calls one that torch 2.13 deprecates (a warning from every rank).
        counts = torch.zeros(trainer.world_size, dtype=torch.long, device=pl_module.device)
        counts[trainer.global_rank] = self.batches
        counts = trainer.strategy.reduce(counts, reduce_op="sum")
        rank_zero_info(f"training batches per rank: {counts.tolist()} (world size {trainer.world_size})")


class UnreadableImageReport(L.Callback):
    """Counts the images that failed to decode (each was named in a warning when it first
    failed) as `<stage>/unreadable_images`, summed over the epoch and the ranks by Lightning's
    own logging (see the note above), and warns once the stage's count is known.

    A stage that decoded no image and failed some (the data folder unmounted or moved while
    the run went on) stops the run: it trained on nothing and logged 0.0 accuracy to the end,
    and a sweep took the 0.0 for the trial's score. A validation stops it before its
    checkpoint is saved (the checks run before ModelCheckpoint's hooks of the same name:
    Lightning puts checkpoint callbacks last); a training epoch, once its metrics are
    reduced, at the next epoch's start. So does a class whose every training image has failed
    to decode (the run trained around it); one whose every validation image has is warned of,
    as a class with none in the val split is."""

    def __init__(self) -> None:
        self.counted_epochs: dict[str, int] = {}  # stage -> the epoch it counted, not yet reported
        self._unscored: set[str] = set()  # the val classes warned of

    @staticmethod
    def monitorable_metrics() -> set[str]:
        """What a fit leaves of it for other callbacks to monitor (train.py checks monitors)."""
        return {"train/unreadable_images", "val/unreadable_images"}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._count(trainer, pl_module, "train")

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._count(trainer, pl_module, "val")

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._count(trainer, pl_module, "test")

    def _count(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dataset = getattr(trainer.datamodule, "datasets", {}).get(stage)
        if dataset is None:
            return
        self.counted_epochs[stage] = trainer.current_epoch
        # the failures since the last batch, in this rank's workers; the decoded images for the
        # check alone, not to the loggers
        counts = {
            "unreadable_images": dataset.take_unreadable_count(),
            "decoded_images": pl_module.batch_counts.images,
        }
        for name, count in counts.items():
            pl_module.log(
                f"{stage}/{name}",
                # made on the device: Lightning would copy a float there, a device sync each batch
                torch.full((), float(count), device=pl_module.device),
                on_step=False,
                on_epoch=True,
                reduce_fx="sum",
                sync_dist=True,
                batch_size=1,
                # none in the patch-budget sweep's trainer, where Lightning would warn of it
                logger=name == "unreadable_images" and bool(trainer.loggers),
            )

    # Lightning has reduced the epoch's metrics by these hooks (the train epoch's by the
    # next epoch's start, or the end of fit).
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "train")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "train")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._report(trainer, "val")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "test")

    def _report(self, trainer: L.Trainer, stage: str) -> None:
        """Warn of the epoch's unreadable images; stop where it decoded none. On every rank
        alike: the reduced metrics are equal on all of them."""
        if stage not in self.counted_epochs:
            return
        epoch = self.counted_epochs.pop(stage)  # once per counted epoch
        # a test is no epoch: after a fit current_epoch is the number of epochs trained
        counted = stage if stage == "test" else f"{stage} epoch {epoch}"
        failed, decoded = (
            self._total(trainer, f"{stage}/{name}") for name in ("unreadable_images", "decoded_images")
        )
        if failed and trainer.is_global_zero:
            # a log line: Python shows a warning from one place once, here the first epoch's
            count = f"{failed} image{'s' if failed > 1 else ''}"
            log.warning("%s: skipped %s that could not be decoded", counted, count)
        if failed and not decoded:
            # a validation's stop comes before its save, which a resume runs again; a training
            # epoch's, after the epoch's end was saved
            again = (
                "train again: its steps, which trained on no image, are in the run's checkpoints"
                if stage == "train"
                else f"run again ({resume_overrides()} resumes a training run)"
            )
            raise DataError(
                f"{counted}: none of its {failed} images could be decoded (named above): "
                f"the images under {trainer.datamodule.root} are gone or damaged; restore them and {again}"
            )
        if stage == "train" and failed + self._total(trainer, "val/unreadable_images"):
            self._check_classes_never_decoded(trainer)

    def _check_classes_never_decoded(self, trainer: L.Trainer) -> None:
        """The classes whose every training or validation image has failed to decode, on
        whichever rank each was dealt to: one reduce of an int an image, on every rank alike
        (the reduced counts that call it are equal on all of them)."""
        datasets = trainer.datamodule.datasets
        splits = [split for split in ("train", "val") if split in datasets]
        failed = torch.from_numpy(np.concatenate([datasets[split].failed() for split in splits]))
        failed = trainer.strategy.reduce(failed.int().to(trainer.strategy.root_device), reduce_op="sum")
        failed = (failed > 0).cpu().numpy()
        start = 0
        for split in splits:
            labels = datasets[split].images.labels
            split_failed, start = failed[start : start + len(labels)], start + len(labels)
            counts = np.bincount(labels)
            failing = np.bincount(labels[split_failed], minlength=len(counts))
            never = np.flatnonzero((counts > 0) & (failing == counts))
            if not len(never):
                continue
            names = trainer.datamodule.class_names()
            classes = ", ".join(f"{names[label]} ({counts[label]})" for label in never[:5])
            classes += ", ..." if len(never) > 5 else ""
            if split == "train":
                raise DataError(
                    f"train: every image of class {classes} failed to decode (named above), and the "
                    f"run trained around it: restore them and resume ({resume_overrides()}), or remove "
                    "the class folder and train anew"
                )
            if classes not in self._unscored:
                self._unscored.add(classes)
                rank_zero_warn(
                    f"val: every image of class {classes} failed to decode (named above): val/acc "
                    "says nothing of it; restore them"
                )

    @staticmethod
    def _total(trainer: L.Trainer, name: str) -> int:
        """The epoch's count of `name`; of an evaluation at several patch budgets, which logs
        it per loader, each over every image, the largest."""
        totals = [
            value
            for key, value in trainer.callback_metrics.items()
            if key.split("/dataloader_idx_")[0] == name
        ]
        return int(max(totals, default=0))


class StopEarly(EarlyStopping):
    """Lightning's EarlyStopping, and a run it stopped stays stopped: resumed from its last
    checkpoint (the same command again, ckpt_path=last), it trained another epoch before it
    stopped again, or on to its end after a stop at a threshold. The callback's counts and
    the reason it stopped are in the checkpoint, its decision was not. The patience and
    thresholds are the command's (Lightning's restores the checkpoint's patience), so that a
    larger patience, or a threshold moved or set to null, goes on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not is_whole(self.patience) or self.patience < 0:
            # a negative one stopped at the first validation without a rise, as 0 does
            raise ConfigError(
                f"callbacks.early_stopping.patience={self.patience} must be a whole number, 0 or more"
            )
        # the monitored value of the last check: a threshold's stop compared it, not the best
        self.last_score: float | None = None

    @property
    def state_key(self) -> str:  # EarlyStopping's: checkpoints written with it keep their counts
        return super().state_key.replace(type(self).__qualname__, EarlyStopping.__qualname__, 1)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_score": self.last_score}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience
        self.last_score = state_dict.get("last_score")  # checkpoints from before it: none

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        # A fit that trainer.max_steps ends inside its first epoch has not validated: the
        # check at that epoch's end failed the run for want of val/acc (train.py refuses a
        # monitor that the model never logs).
        if self.monitor in trainer.callback_metrics:
            super()._run_early_stopping_check(trainer)

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> tuple[bool, str | None]:
        # the reason of this check's stop, if any: Lightning kept an earlier stop's, and a run
        # resumed past it, then ended at max_epochs, stayed stopped at its next resume
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.last_score = current.item()
        return super()._evaluate_stopping_criteria(current)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop = self._stop_that_holds()  # every rank loaded the same state
        if stop is not None:
            why, to_go_on = stop
            trainer.should_stop = True
            rank_zero_info(f"{why} when this run stopped early: it stays stopped (to go on, {to_go_on})")

    def _stop_that_holds(self) -> tuple[str, str] | None:
        """Why the checkpoint's stop holds under this command's settings, and the change that
        lets it go on; None if it does not hold."""
        setting = "callbacks.early_stopping."
        if 0 < self.wait_count >= self.patience:
            return (
                f"{self.monitor} had not improved for {self.wait_count} validations",
                f"raise {setting}patience",
            )
        at_threshold = self.stopping_reason not in (
            EarlyStoppingReason.NOT_STOPPED,
            EarlyStoppingReason.PATIENCE_EXHAUSTED,
        )
        if not at_threshold or self.last_score is None:  # a checkpoint from before last_score: goes on
            return None
        last = torch.tensor(self.last_score)
        if self.check_finite and not torch.isfinite(last):
            return f"{self.monitor} was not finite", f"set {setting}check_finite=false"
        if self.stopping_threshold is not None and self.monitor_op(last, self.stopping_threshold):
            return (
                f"{self.monitor}={last.item():g} had reached stopping_threshold={self.stopping_threshold}",
                f"move {setting}stopping_threshold past it or set it to null",
            )
        if self.divergence_threshold is not None and self.monitor_op(-last, -self.divergence_threshold):
            return (
                f"{self.monitor}={last.item():g} had passed divergence_threshold={self.divergence_threshold}",
                f"move {setting}divergence_threshold past it or set it to null",
            )
        return None
