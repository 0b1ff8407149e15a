"""The LightningModule: NaViT over packed batches, a head per image, cross-entropy, accuracy."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from omegaconf import OmegaConf
from torch import nn
from torchmetrics import MaxMetric, Metric

from navit_lightning.batch import IGNORE_LABEL, PackedBatch, check_layout, image_index
from navit_lightning.errors import ConfigError, require_flags
from navit_lightning.models import NaViT, build_head
from navit_lightning.utils.checkpoints import numbered_classes, read_checkpoint, run_class_names
from navit_lightning.utils.schedules import check_lr_scaling, limited, lr_scale, step_factors

if TYPE_CHECKING:
    from typing_extensions import Self

# What a resumed optimizer keeps from its checkpoint: its parameters, and the rates its
# schedule sets.
SCHEDULED_SETTINGS = ("params", "lr", "initial_lr")

# The most classes whose validation confusion matrix is kept: its counts (classes^2) are
# summed over the ranks at every validation, 8 MB at 1,000 classes, 800 MB at 10,000.
MAX_CONFUSION_CLASSES = 1000

# Logged at each training step only: the batch's images, and its real tokens' share of its slots.
TRAIN_STEP_LOGS = ("train/images_per_batch", "train/fill")

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]


class ResumePoint(NamedTuple):
    """Where a checkpoint's run stood: its optimizer steps, its epoch, and the batches of it
    each rank had trained and had planned (all of them once the epoch was over)."""

    global_step: int
    epoch: int
    batches_done: int
    batches_planned: int

    @classmethod
    def of(cls, checkpoint: dict) -> ResumePoint | None:
        """From the training loader's position (data.datamodule.TrainLoader), where it has one."""
        loaders = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
        position = loaders[0] if loaders else {}
        if "batches_done" not in position:
            return None
        return cls(
            checkpoint["global_step"],
            position["epoch"],
            position["batches_done"],
            position["batches_per_rank"],
        )

    def batches_left(self, epoch_batches: int) -> int:
        """The batches of its epoch still to train, of `epoch_batches` an epoch at most."""
        return max(0, min(self.batches_planned, epoch_batches) - self.batches_done)


def image_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's real images. A sum divided by their count, not a
    mean over slots: an all-padding filler batch (see PackedBatchSampler) then gives a zero
    loss instead of NaN."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL, reduction="sum")
    return loss / max(len(labels), 1)


class StatesOf32Bits(Metric):
    """trainer.precision=bf16-true or 16-true calls .to(dtype), which turns a metric's
    states too: a sum of 16-bit floats stops counting images at 256, and a best accuracy
    keeps 3 digits. Here the states move, and keep 32 bits."""

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> nn.Module:
        def at_least_32_bits(tensor: torch.Tensor) -> torch.Tensor:
            tensor = fn(tensor)
            return tensor.float() if tensor.is_floating_point() and tensor.element_size() < 4 else tensor

        return super()._apply(at_least_32_bits, exclude_state)


class HighestValue(StatesOf32Bits, MaxMetric):
    """MaxMetric, in 32 bits under any precision."""


class ImageMean(StatesOf32Bits):
    """The mean of a per-image value (a loss, a correct prediction) over an epoch's images on
    every rank: each rank sums the values of its images and counts them, and the sync before
    compute() adds both across ranks. Logged as a plain tensor, the epoch's loss would be each
    rank's batch mean averaged (in training rank 0's alone), with an all-padding filler batch
    counted as one image of loss 0. Not torchmetrics' MeanMetric: it checks every value for
    NaN (a device sync each step), and without that check (nan_strategy="disable") it drops
    the weights (torchmetrics 1.9). Not its MulticlassAccuracy: it refuses a filler batch's
    empty input (torchmetrics#2279), and a rank given only filler batches then warns that
    compute() came before any update."""

    full_state_update = False  # forward() updates the state once, not twice

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("images", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, total: torch.Tensor, images: int) -> None:
        """`total`: the value summed over the batch's `images` images (a count on the host: no
        sync); 0 for a filler batch."""
        self.total += total.detach().float()
        self.images += images

    def compute(self) -> torch.Tensor:
        return self.total / self.images.clamp(min=1)


class ConfusionCounts(Metric):
    """How many images of each true class (rows) were predicted as each class (columns), over
    every rank. Not torchmetrics' MulticlassConfusionMatrix: under torch's deterministic mode
    (trainer.deterministic, on by default) it counts through an (images, classes^2) comparison,
    which took 4.2 GB and 0.7 s a validation step at 1,000 classes and ran out of memory at
    10,000. torch.bincount without weights is deterministic on CPU and CUDA."""

    full_state_update = False

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.add_state(
            "counts", torch.zeros(num_classes * num_classes, dtype=torch.long), dist_reduce_fx="sum"
        )

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        pairs = labels * self.num_classes + logits.argmax(-1)  # (images,) true x classes + predicted
        self.counts += torch.bincount(pairs, minlength=self.num_classes**2)

    def compute(self) -> torch.Tensor:
        return self.counts.view(self.num_classes, self.num_classes)


class BatchCounts(NamedTuple):
    """Counts of a batch, taken on the host before it goes to the device: reading them from
    the device copy would stall the host until the GPU caught up (a device sync each)."""

    images: int
    real_tokens: int
    tokens: int

    @classmethod
    def of(cls, batch: PackedBatch) -> BatchCounts:
        return cls(batch.num_images, batch.num_real_tokens, batch.image_ids.numel())


def parameter_groups(module: nn.Module) -> list[dict]:
    """No weight decay on biases, norms and other vectors, nor on what a submodule names in
    its no_weight_decay() (NaViT: the position tables, the pooling query): the usual ViT
    recipe."""
    exempt = {
        f"{prefix}.{name}" if prefix else name
        for prefix, submodule in module.named_modules()
        if hasattr(submodule, "no_weight_decay")
        for name in submodule.no_weight_decay()
    }
    decayed, kept = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (decayed if param.ndim >= 2 and name not in exempt else kept).append(param)
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]


class NaViTClassifier(L.LightningModule):
    def __init__(
        self,
        net: NaViT,
        num_classes: int,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        head: str = "linear",
        compile: bool = False,
        lr_scaling: str | None = None,
        lr_reference_tokens: int = 2016,
    ) -> None:
        super().__init__()
        check_lr_scaling(lr_scaling, lr_reference_tokens)
        require_flags("model", compile=compile)
        self.net = net
        self.head = build_head(head, net.num_features, num_classes)
        self.num_classes = num_classes
        # the labels' names: load_from_checkpoint sets the checkpoint's
        self.class_names: list[str] | None = None
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile = compile
        self.lr_scaling = lr_scaling
        self.lr_reference_tokens = lr_reference_tokens
        # Each stage's mean loss and accuracy (ImageMean), "<stage>_loss" and "<stage>_acc"
        # (a bare "train" key would clash with nn.Module.train); more during a budget sweep.
        self.metrics = nn.ModuleDict()
        for stage in ("train", "val", "test"):
            self._ensure_metrics(stage, 0)
        # Fed the synced val accuracy, the same on every rank: nothing left to sync.
        self.val_acc_best = HighestValue(sync_on_compute=False)
        # Of the validation images, over every rank: the last epoch's, for pictures.LogPictures;
        # none past MAX_CONFUSION_CLASSES.
        self.val_confusion = ConfusionCounts(num_classes) if num_classes <= MAX_CONFUSION_CLASSES else None
        if self.val_confusion is None:
            rank_zero_info(
                f"{num_classes} classes: no confusion matrix of the validation images (kept up to "
                f"{MAX_CONFUSION_CLASSES} classes; its counts, classes^2, are summed over the ranks)"
            )
        self.val_confusion_matrix: torch.Tensor | None = None
        # Taken from the next batch on the host by on_before_batch_transfer, used once by its step.
        self._host_counts: BatchCounts | None = None
        # Of the latest step's batch: read by PackedThroughputMonitor, and the model FLOPs by
        # Lightning's ThroughputMonitor.
        self.batch_counts = BatchCounts(0, 0, 0)
        self.flops_per_batch = 0
        # The images of this optimizer step's batches so far, on this rank, and whether
        # training_step returned their summed losses (not a subclass's own step).
        self._step_images = 0
        self._summed_losses = False
        # The schedule's length and what it follows (configure_optimizers), and a checkpoint's,
        # with where that checkpoint's run stood.
        self._schedule: dict | None = None
        self._saved_schedule: dict | None = None
        self._resumed_at: ResumePoint | None = None

    @_restricted_classmethod  # Lightning's: on an instance it would not load into it
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | Path | IO[bytes],
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **settings: Any,
    ) -> Self:
        """The model a checkpoint of train.py holds, from Python (a notebook, a service), in
        eval mode, as Lightning's method takes them (map_location, strict; it reads weights
        only). Lightning's builds from saved hyperparameters, which train.py does not save (the
        network and the optimizer are objects Hydra builds): this one builds the class it is
        called on (the checkpoint's, or a subclass) from the training config the checkpoint
        stores, `settings` merged into its model.* (compile=False, net={"attention": "sdpa"}).
        `class_names`: the labels' names."""
        if hparams_file is not None:
            raise ConfigError(
                f"hparams_file={hparams_file}: the model is built from the training config the "
                "checkpoint stores; give its model.* settings as keywords"
            )
        checkpoint = read_checkpoint(checkpoint_path, "checkpoint_path", map_location or "cpu")
        config = OmegaConf.merge(checkpoint["run_config"]["model"], settings)
        trained = hydra.utils.get_class(config.pop("_target_"))
        if not issubclass(cls, trained):
            raise ConfigError(
                f"{checkpoint_path} holds a {trained.__name__}, which {cls.__name__} does not derive "
                f"from: load it with {trained.__module__}.{trained.__qualname__}.load_from_checkpoint"
            )
        # a subclass's (*args, **kwargs) passes the trained class's settings on
        accepted = {*inspect.signature(cls).parameters, *inspect.signature(trained).parameters}
        if unknown := sorted(set(settings) - accepted):
            raise ConfigError(f"{', '.join(unknown)}: not settings of {cls.__name__}")
        model = cls(**hydra.utils.instantiate(config, _convert_="all"))
        model.on_load_checkpoint(checkpoint)
        model.load_state_dict(checkpoint["state_dict"], strict=strict is not False)
        model.class_names = run_class_names(checkpoint) or numbered_classes(model.num_classes)
        state = (value for value in checkpoint["state_dict"].values() if isinstance(value, torch.Tensor))
        return model.to(next(state).device).eval()  # where map_location put the weights, as Lightning

    def setup(self, stage: str) -> None:
        # Each stage's metrics start from nothing, in tensors of their own: a ddp_spawn rank
        # gets its states in memory shared with the other ranks and the launching process
        # (Lightning un-shares parameters and buffers only), where an earlier stage left its
        # counts (the first budget of the end-of-fit sweep counted fit's sanity check and
        # every image twice). A checkpoint's val_acc_best is restored after this.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()
        if stage == "fit":
            self._refuse_images_past_the_tables()
        if self.compile and stage == "fit":
            self.net.compile()  # in place: the state_dict keys stay those of the plain network

    def _refuse_images_past_the_tables(self) -> None:
        """Before a fit, from the data's image sizes: an image longer than the absolute position
        tables stopped the fit at the batch that held it, hours in maybe, and its resume there."""
        longest_side = getattr(self.trainer.datamodule, "longest_side", None)
        if longest_side is not None and not self.net.pos_embed.fractional:  # fractional: no bound
            for split in ("train", "val"):
                patches, image = longest_side(split)
                self.net.pos_embed.check_side(patches, f"{split} image {image}")

    def forward(self, batch: PackedBatch, index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (N, classes) of the batch's N images, in row-major slot order; `index`: their
        flat slot index (batch.image_index), found here when not given."""
        index = image_index(batch) if index is None else index
        features = self.net(batch)  # (R, K, dim)
        # The head sees only real images: BatchNorm statistics must not count empty slots.
        return self.head(features.flatten(0, 1)[index])

    def _take_counts(self, batch: PackedBatch) -> BatchCounts:
        # Counted here (a device sync on a GPU) only for a step called outside Lightning's loops.
        counts = BatchCounts.of(batch) if self._host_counts is None else self._host_counts
        self._host_counts, self.batch_counts = None, counts
        return counts

    def _ensure_metrics(self, stage: str, dataloader_idx: int) -> tuple[str, str]:
        """Makes `stage`'s mean loss and accuracy over its loader `dataloader_idx` where
        self.metrics lacks them, and returns their names there: an evaluation across patch
        budgets has a loader per budget (resolution.py), each counted apart in metrics made at
        its first batch."""
        suffix = "" if dataloader_idx == 0 else f"_{dataloader_idx}"
        loss, accuracy = f"{stage}_loss{suffix}", f"{stage}_acc{suffix}"
        if loss not in self.metrics:
            self.metrics[loss] = ImageMean().to(self.device)
            self.metrics[accuracy] = ImageMean().to(self.device)
        return loss, accuracy

    @staticmethod
    def monitorable_metrics() -> set[str]:
        """What a callback may monitor: the names a fit leaves in trainer.callback_metrics.
        Lightning adds _step and _epoch to a metric logged both ways (the training loss)."""
        means = {f"{stage}/{name}" for stage in ("train", "val") for name in ("loss", "acc")}
        return means | {"train/loss_step", "train/loss_epoch", "val/acc_best", *TRAIN_STEP_LOGS}

    def _step(self, batch: PackedBatch, stage: str, dataloader_idx: int = 0) -> torch.Tensor:
        counts = self._take_counts(batch)
        num_images = counts.images
        index = image_index(batch, num_images)
        logits = self(batch, index)
        labels = batch.labels.flatten()[index]
        loss = image_loss(logits, labels)
        loss_name, accuracy_name = self._ensure_metrics(stage, dataloader_idx)
        # forward: the batch's value for the step's log too
        self.metrics[loss_name](loss * num_images, num_images)
        self.metrics[accuracy_name].update((logits.argmax(-1) == labels).sum(), num_images)
        if stage == "val" and dataloader_idx == 0 and self.val_confusion is not None:
            self.val_confusion.update(logits, labels)
        # Metrics, not tensors: each syncs its own state across ranks when Lightning computes
        # the epoch's value. metric_attribute: Lightning looks a logged metric's name up once,
        # before any made later.
        for name, metric, on_step in (("loss", loss_name, stage == "train"), ("acc", accuracy_name, False)):
            self.log(
                f"{stage}/{name}",
                self.metrics[metric],
                prog_bar=True,
                on_step=on_step,
                on_epoch=True,
                metric_attribute=f"metrics.{metric}",
            )
        if stage == "train":
            # host tensors: Lightning would copy a float to the device, a sync every step
            step_logs = (float(num_images), counts.real_tokens / counts.tokens)
            for name, value in zip(TRAIN_STEP_LOGS, step_logs, strict=True):
                self.log(name, torch.tensor(value), on_step=True, on_epoch=False)
        return loss

    def on_before_batch_transfer(self, batch: PackedBatch, dataloader_idx: int) -> PackedBatch:
        # Counted and checked here, on the host, before the copy: on the device each is a sync.
        # Also for the callbacks (throughput, unreadable images) where a subclass's own step
        # does not take them.
        self._host_counts = self.batch_counts = BatchCounts.of(batch)
        check_layout(batch.image_ids)
        self.net.pos_embed.check_coords(batch.coords)
        if self.trainer.training:
            self.flops_per_batch = int(self.net.train_flops(batch))
        return batch

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        """The batch's mean loss where one batch makes the step; else its images' summed loss,
        and on_before_optimizer_step divides the step's gradient by the images of all its
        batches. Averaging the batches' means (DDP over ranks, Lightning over accumulated
        batches) weighs an image by how few shared its batch: one alone in a batch as much as
        a batch of twenty, and a rank's all-padding filler batch halved its step at 2 ranks."""
        loss = self._step(batch, "train")
        if self._batches_per_step() == 1:
            return loss
        images = self.batch_counts.images
        self._step_images += images
        self._summed_losses = True
        return loss * images

    def _batches_per_step(self) -> int:
        # self._trainer: None for a step called outside a Trainer (self.trainer raises)
        ranks, accumulation = step_factors(self._trainer)
        return ranks * accumulation

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Every rank runs this hook before each optimizer step, in step: its all_reduce pairs.
        # Not after a subclass's own training_step returning a mean: Lightning's mean of means.
        batches = self._batches_per_step()
        if batches == 1 or not self._summed_losses:
            return
        # DDP's all_reduce and Lightning's accumulation left the mean of the batches' summed
        # gradients: times batches / images, the mean over the step's images. The count made
        # on the device (full, not a copy of a host tensor: no device sync).
        images = torch.full((), float(self._step_images), device=self.device)
        images = self.trainer.strategy.reduce(images, reduce_op="sum")
        self._step_images, self._summed_losses = 0, False
        gradients = [p.grad for p in self.parameters() if p.grad is not None]
        torch._foreach_mul_(gradients, batches / images.clamp(min=1))

    def validation_step(self, batch: PackedBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, "val", dataloader_idx)

    def test_step(self, batch: PackedBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, "test", dataloader_idx)

    def predict_step(self, batch: PackedBatch, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) numbers and (N, classes) class probabilities of the batch's N images: a
        prediction batch carries each image's number in its input list where a training
        batch carries its class (PackedImageDataModule.predict_on)."""
        index = image_index(batch, self._take_counts(batch).images)
        return batch.labels.flatten()[index], self(batch, index).float().softmax(-1)

    def on_validation_epoch_end(self) -> None:
        # compute() syncs the accuracy across ranks, here on every rank, in this hook, which
        # runs before any rank-zero-only callback reads the epoch's metrics (the progress bar
        # reads them in on_validation_end); see the note in utils/callbacks.py.
        # Fit's validations only: eval.py's (split=val) would log its score mixed with the
        # training run's best, which the checkpoint restores.
        fits = self.trainer.state.fn == TrainerFn.FITTING and not self.trainer.sanity_checking
        if fits:
            self.val_acc_best(self.metrics["val_acc"].compute())
            # sync_dist of equal values: no news, but Lightning warns about epoch logs without it
            self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True, sync_dist=True)
        if self.val_confusion is not None:
            if fits:
                self.val_confusion_matrix = self.val_confusion.compute()
            self.val_confusion.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A metric's state is not in the state_dict: a resumed run's val/acc_best (train.py's
        # hp/val_acc, the value a sweep optimises) would be the best since the resume.
        checkpoint["val_acc_best"] = float(self.val_acc_best.max_value)
        if self._schedule is not None:
            checkpoint["schedule"] = self._schedule

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # before configure_optimizers, where a resume takes its run's schedule length back
        if "val_acc_best" in checkpoint:  # not in checkpoints from before it was kept
            self.val_acc_best.max_value.fill_(checkpoint["val_acc_best"])
        self._saved_schedule = checkpoint.get("schedule")
        self._resumed_at = ResumePoint.of(checkpoint)
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        if fitting and checkpoint.get("optimizer_states"):  # not a test of a checkpoint
            self._take_optimizer_settings(checkpoint["optimizer_states"][0]["param_groups"])

    def _take_optimizer_settings(self, saved_groups: list[dict]) -> None:
        """A resumed run's optimizer settings are this command's (optimizer.weight_decay=0.1,
        betas), which the saved state would replace without a word; its rates stay the
        checkpoint's, as its schedule's step does (see _scale_learning_rate)."""
        configured = self.optimizer_factory(params=parameter_groups(self)).param_groups
        if len(configured) != len(saved_groups):
            return  # another optimizer layout: Lightning's load says what does not fit
        changes = {}  # an ordered set: each change once, where the groups share it
        for saved, wanted in zip(saved_groups, configured, strict=True):
            for key, value in wanted.items():
                if key not in SCHEDULED_SETTINGS and key in saved and saved[key] != value:
                    changes[f"{key} {saved[key]} -> {value}"] = None
                    saved[key] = value
        if changes:
            rank_zero_info(f"resumed with this command's optimizer settings: {', '.join(changes)}")

    def _schedule_settings(self) -> list:
        """What the schedule's length follows: a resume with other values has another one."""
        trainer = self.trainer
        step_tokens = getattr(trainer.datamodule, "step_tokens", None)
        return [
            trainer.max_epochs,
            trainer.max_steps,
            trainer.accumulate_grad_batches,
            trainer.world_size,
            str(trainer.limit_train_batches),
            step_tokens() if step_tokens else None,
        ]

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer_factory(params=parameter_groups(self))
        self._scale_learning_rate(optimizer)
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        # Lightning's estimate counts the batches of the epoch its loader is at: a run resumed
        # in an epoch packed into a batch more or fewer than the first (each epoch is packed
        # anew) had another schedule from there. The run's own length, where its settings are.
        settings = self._schedule_settings()
        saved = self._saved_schedule
        steps = saved["steps"] if saved and saved["settings"] == settings else self._schedule_length()
        self._schedule = {"steps": steps, "settings": settings}
        scheduler = self.scheduler_factory(optimizer, steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _schedule_length(self) -> int | float:
        """The optimizer steps of the whole run: Lightning's estimate for a fresh one. A run
        resumed with other settings: the steps it made, then those still to come at this
        run's batches per epoch. Lightning's estimate counts every epoch at this run's: an
        epoch-end resume on twice the ranks put the end of the cosine at its first step."""
        trainer = self.trainer
        estimate = trainer.estimated_stepping_batches
        resumed = self._resumed_at
        if resumed is None or trainer.max_epochs == -1 or not math.isfinite(estimate):
            return estimate
        batches = trainer.num_training_batches  # an epoch's, limit_train_batches applied
        next_epoch_batches = getattr(trainer.datamodule, "train_batches_per_rank", None)
        if resumed.batches_done >= resumed.batches_planned and next_epoch_batches is not None:
            # the loader keeps the length of an epoch resumed after its batches, from the
            # checkpoint's settings (its validation still to run): later epochs have this run's
            batches = limited(next_epoch_batches(), trainer.limit_train_batches)
        per_step = trainer.accumulate_grad_batches
        later_epochs = max(0, trainer.max_epochs - resumed.epoch - 1)
        steps = resumed.global_step + math.ceil(resumed.batches_left(batches) / per_step)
        steps += later_epochs * math.ceil(batches / per_step)
        return steps if trainer.max_steps == -1 else min(steps, trainer.max_steps)

    def _scale_learning_rate(self, optimizer: torch.optim.Optimizer) -> None:
        """model.lr_scaling: optimizer.lr, tuned at lr_reference_tokens a step, carried to this
        run's effective batch, before the schedule takes it as its base. A resumed run gets
        the rates it saved back from its checkpoint afterwards (with the schedule's state)."""
        if self.lr_scaling is None:
            return
        step_tokens = getattr(self.trainer.datamodule, "step_tokens", None)
        if step_tokens is None:
            raise ConfigError(
                "model.lr_scaling needs the run's datamodule (its step_tokens): or set it to null"
            )
        tokens = step_tokens()
        scale = lr_scale(self.lr_scaling, tokens, self.lr_reference_tokens)
        for group in optimizer.param_groups:
            group["lr"] *= scale
        resumed = "; the checkpoint's own rates replace it" if self.trainer.ckpt_path else ""
        rank_zero_info(
            f"learning rate: optimizer.lr x {scale:.3g} = {optimizer.param_groups[0]['lr']:.3g} "
            f"({self.lr_scaling}: {tokens} tokens a step, tuned at {self.lr_reference_tokens}){resumed}"
        )
