"""Pictures of what the project does (packed batches, predictions, the confusion matrix) for
the loggers that show them; resolution.py draws accuracy across resolutions with log_figure.
Figures are built without pyplot: no display, no global figure state."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from einops import rearrange
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torchmetrics.classification import MulticlassConfusionMatrix

from navit_lightning.batch import PackedBatch, image_index

SLOT_COLOURS = colormaps["tab10"]


def unpack_images(batch: PackedBatch, patch_size: int, rows: int | None = None) -> list[list[np.ndarray]]:
    """The images of each of the first `rows` rows, in slot order, as (H, W, C) uint8 pixels;
    dropped tokens stay black."""
    batch = PackedBatch(*(field[:rows].cpu() for field in batch))
    channels = batch.patches.shape[-1] // patch_size**2
    unpacked = []
    for patches, coords, image_ids, grid in zip(*batch[:4], strict=True):
        images = []
        for slot, (height, width) in enumerate(grid.tolist()):
            if not height:
                continue
            tokens = image_ids == slot
            canvas = torch.zeros(height, width, patch_size, patch_size, channels, dtype=torch.uint8)
            y, x = coords[tokens].unbind(-1)
            canvas[y, x] = patches[tokens].view(-1, patch_size, patch_size, channels)
            images.append(rearrange(canvas, "h w p1 p2 c -> (h p1) (w p2) c").numpy())
        unpacked.append(images)
    return unpacked


def packed_batch_figure(batch: PackedBatch, patch_size: int, rows: int = 6) -> Figure:
    """What packing does, at a glance: the first rows of a batch, each row's images side by
    side at their own size, each framed in its slot's colour, with how full the row is."""
    images = unpack_images(batch, patch_size, rows)
    height = max((image.shape[0] for row in images for image in row), default=patch_size)
    gap = patch_size // 2
    figure = Figure(figsize=(10, 1.2 * len(images) + 0.5), layout="constrained")
    tokens = (batch.image_ids[: len(images)] >= 0).sum(-1).tolist()
    for index, (row, used) in enumerate(zip(images, tokens, strict=True)):
        axes = figure.add_subplot(len(images), 1, index + 1)
        width = sum(image.shape[1] + gap for image in row) or patch_size
        canvas = np.full((height, width, row[0].shape[2] if row else 3), 255, dtype=np.uint8)
        left = 0
        for slot, image in enumerate(row):
            canvas[: image.shape[0], left : left + image.shape[1]] = image
            axes.add_patch(
                Rectangle(
                    (left - 0.5, -0.5),
                    image.shape[1],
                    image.shape[0],
                    fill=False,
                    edgecolor=SLOT_COLOURS(slot % SLOT_COLOURS.N),
                    linewidth=2,
                )
            )
            left += image.shape[1] + gap
        axes.imshow(canvas.squeeze(-1) if canvas.shape[2] == 1 else canvas, cmap="gray")
        axes.set_axis_off()
        row_len = batch.image_ids.shape[1]
        axes.set_title(
            f"row {index}: {len(row)} images, {used} of {row_len} tokens ({used / row_len:.0%})",
            fontsize=8,
            loc="left",
        )
    return figure


def drawn_as_written(name: str) -> str:
    """A class folder's name as matplotlib can draw it: a `$` pair would start math text (a
    class `$5_$10` ended the run), and a name that is not UTF-8 (surrogates) has no glyphs."""
    return name.encode(errors="replace").decode().replace("$", r"\$")


def predictions_figure(
    images: Sequence[np.ndarray], predicted: Sequence[str], true: Sequence[str], columns: int = 6
) -> Figure:
    """Images titled with their predicted and true class, green where they agree."""
    rows = max(1, math.ceil(len(images) / columns))
    figure = Figure(figsize=(1.8 * columns, 2.0 * rows), layout="constrained")
    for index, (image, guess, truth) in enumerate(zip(images, predicted, true, strict=True)):
        axes = figure.add_subplot(rows, columns, index + 1)
        axes.imshow(image.squeeze(-1) if image.shape[2] == 1 else image, cmap="gray")
        axes.set_axis_off()
        title = f"{drawn_as_written(guess)}\n(true: {drawn_as_written(truth)})"
        axes.set_title(title, fontsize=8, color="green" if guess == truth else "red")
    return figure


# Beyond this many classes torchmetrics' plot, a count written in every cell of a figure
# that grows with the classes, took 13.5 s and 1.9 GB at 100 classes, 63.5 s and 6.4 GB at
# 200, at every validation.
MAX_LABELLED_CLASSES = 30


def confusion_figure(matrix: torch.Tensor, class_names: Sequence[str]) -> Figure:
    """torchmetrics' own confusion matrix plot of an already computed matrix; beyond
    MAX_LABELLED_CLASSES, each true class's row as shares, drawn as an image of a fixed size."""
    classes = len(class_names)
    if classes <= MAX_LABELLED_CLASSES:
        figure = Figure(figsize=(1 + 0.6 * classes, 0.6 * classes + 0.8), layout="constrained")
        plotter = MulticlassConfusionMatrix(classes)
        plotter.plot(
            val=matrix.cpu(), ax=figure.add_subplot(), labels=list(map(drawn_as_written, class_names))
        )
        return figure
    counts = matrix.cpu().float()
    shares = counts / counts.sum(1, keepdim=True).clamp(min=1)
    figure = Figure(figsize=(8, 7), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(shares.numpy(), vmin=0, vmax=1, interpolation="nearest")
    figure.colorbar(image, ax=axes, label="share of the true class's images")
    axes.set_xlabel(f"predicted class (0..{classes - 1}, in label order)")
    axes.set_ylabel("true class")
    return figure


def log_figure(loggers: Sequence[Logger], tag: str, figure: Figure, step: int) -> None:
    """Give `figure` to every logger that shows pictures (the others have no place for it)."""
    for logger in loggers:
        experiment: Any = logger.experiment
        if isinstance(logger, TensorBoardLogger):
            experiment.add_figure(tag, figure, global_step=step, close=False)
        elif isinstance(logger, MLFlowLogger):
            experiment.log_figure(logger.run_id, figure, f"{tag}_{step}.png")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[figure], step=step)


def scalar_step(trainer: L.Trainer) -> int:
    """The step Lightning logs the scalars of this moment at, its count of optimizer steps
    before this batch's: a batch's loss, a validation's accuracy. The pictures beside them go
    there too (at trainer.global_step, which counts this batch's step already, they came one
    step after)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


class LogPictures(L.Callback):
    """Pictures for the loggers that show them, never during the sanity check: the first
    packed training batch of every epoch, the first validation batch's images with their
    predicted and true classes, and the validation confusion matrix (every rank's images).
    Drawn on global rank zero alone, with no collective: the matrix was synced by the
    LightningModule in on_validation_epoch_end, on every rank."""

    def __init__(self, rows: int = 6, images: int = 18) -> None:
        self.rows = rows
        self.images = images
        self.class_names: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # once: an image folder's names come from listing its class folders
        self.class_names = trainer.datamodule.class_names()

    def _drawing(self, trainer: L.Trainer) -> bool:
        return trainer.is_global_zero and bool(trainer.loggers) and not trainer.sanity_checking

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: PackedBatch,
        batch_idx: int,
    ) -> None:
        if batch_idx == 0 and self._drawing(trainer):
            figure = packed_batch_figure(batch, pl_module.net.patch_size, self.rows)
            log_figure(trainer.loggers, "pictures/packed_batch", figure, scalar_step(trainer))

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: PackedBatch,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx != 0 or not self._drawing(trainer):
            return
        index = image_index(batch)[: self.images]
        with trainer.precision_plugin.forward_context():
            predicted = pl_module(batch, index).argmax(-1).tolist()
        images = [image for row in unpack_images(batch, pl_module.net.patch_size) for image in row]
        true = batch.labels.flatten()[index].tolist()
        names = self.class_names
        figure = predictions_figure(
            images[: len(predicted)], [names[c] for c in predicted], [names[c] for c in true]
        )
        log_figure(trainer.loggers, "pictures/val_predictions", figure, scalar_step(trainer))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        matrix = pl_module.val_confusion_matrix
        if matrix is not None and self._drawing(trainer):
            figure = confusion_figure(matrix, self.class_names)
            log_figure(trainer.loggers, "pictures/confusion_matrix", figure, scalar_step(trainer))
