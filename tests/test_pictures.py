"""Pictures in TensorBoard: what a short default run shows, and that a packed batch is drawn
from exactly its images."""

import contextlib
import re
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from omegaconf import open_dict
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from navit_lightning.batch import PackedBatch, PackedShape, image_index
from navit_lightning.data.datamodule import EFFECTIVE_BATCH_METRICS
from navit_lightning.data.packing import pack
from navit_lightning.data.transforms import image_to_sample
from navit_lightning.pictures import (
    LogPictures,
    confusion_figure,
    log_figure,
    packed_batch_figure,
    predictions_figure,
    unpack_images,
)
from navit_lightning.train import build
from tests.conftest import TINY_RUN, logged_scalars, run_folder
from tests.test_configs import compose_train


def test_unpacked_images_are_the_packed_ones_pixel_for_pixel():
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (h * 8, w * 8, 3), dtype=np.uint8) for h, w in [(2, 5), (4, 1), (3, 3)]]
    samples = [image_to_sample(Image.fromarray(p), label, 8, 64) for label, p in enumerate(pictures)]
    batch = pack(samples, PackedShape(rows=2, row_len=16, max_images=4), 8 * 8 * 3)
    unpacked = [image for row in unpack_images(batch, 8) for image in row]
    # every image comes back once, whatever row and slot the packer gave it
    order = batch.labels.flatten()[batch.labels.flatten() >= 0].tolist()
    assert sorted(order) == [0, 1, 2]
    for label, image in zip(order, unpacked, strict=True):
        np.testing.assert_array_equal(image, pictures[label])
    figure = packed_batch_figure(batch, 8)
    assert len(figure.axes) == 2
    for axes, row in zip(figure.axes, unpack_images(batch, 8), strict=True):  # each row's fill
        used = sum(image.shape[0] * image.shape[1] for image in row) // 8**2
        assert f"{len(row)} images, {used} of 16 tokens" in axes.get_title(loc="left")


@pytest.mark.slow
def test_a_short_default_run_shows_pictures_and_hparams(run_entry_point):
    run_entry_point("train.py", *TINY_RUN, "trainer.max_epochs=2")
    run = run_folder(run_entry_point.root)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    images = {tag: [event.step for event in events.Images(tag)] for tag in events.Tags()["images"]}
    pictures = ["pictures/packed_batch", "pictures/val_predictions", "pictures/confusion_matrix"]
    assert {*pictures, "resolution/accuracy"} <= set(images)
    scalars = logged_scalars(run / "tensorboard")
    validations = [step for step, _ in scalars["val/acc"]]
    # one picture per validation, none from the sanity check, at the step of its scalars (they
    # were one step after them); the packed batch at each epoch's first loss
    for tag in ("pictures/val_predictions", "pictures/confusion_matrix"):
        assert images[tag] == validations and len(validations) == 2, (tag, images[tag])
    losses = [step for step, _ in scalars["train/loss_step"]]
    assert images["pictures/packed_batch"] == [0, len(losses) // 2] and losses == list(range(len(losses)))
    # the HPARAMS tab: the run's settings and its final results
    assert "hp/val_acc" in str(events.PluginTagToContent("hparams"))
    assert scalars["hp/val_acc"][-1][1] == pytest.approx(max(value for _, value in scalars["val/acc"]))
    assert scalars["hp/test_acc"][-1][1] == pytest.approx(scalars["test/acc"][-1][1])
    # which test/acc tested: the checkpoint of the best val/acc (the first of equals)
    accuracies = [value for _, value in scalars["val/acc"]]
    (best,) = (run / "checkpoints").glob("epoch_*.ckpt")
    assert best.name == f"epoch_{accuracies.index(max(accuracies)):03d}.ckpt", accuracies
    # and what a step consumed, which training prints at its start (they reached hparams.yaml only)
    assert "effective_batch/tokens" in str(events.PluginTagToContent("hparams"))
    printed = re.search(r"= (\d+) tokens, ~(\d+) images", (run / "train.log").read_text())
    assert scalars["effective_batch/tokens"][-1][1] == int(printed.group(1))
    assert round(scalars["effective_batch/images"][-1][1]) == int(printed.group(2))


@pytest.mark.parametrize(
    ("overrides", "declared"),
    [
        ([], ["hp/test_acc", "hp/val_acc", *EFFECTIVE_BATCH_METRICS]),
        (["test=false"], ["hp/val_acc", *EFFECTIVE_BATCH_METRICS]),
        (["train=false", "ckpt_path=best"], ["hp/test_acc"]),
    ],
)
def test_the_hparams_tab_declares_only_the_results_the_run_gives(tmp_path, project_root, overrides, declared):
    """A run without a test (Optuna's trials, debug=overfit) showed hp/test_acc at its
    placeholder, 0.0, as its result; one that does not train has no effective batch. Declared
    with no value: a placeholder logged at step 0 was the run's last value where a resume was
    refused before its first step."""
    cfg = compose_train(overrides, tmp_path, project_root)
    with open_dict(cfg):
        del cfg.hydra  # Hydra's own node, as a run's config holds none (set by compose_train)
    _, _, trainer = build(cfg)
    trainer.logger.experiment.flush()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    content = str(events.PluginTagToContent("hparams"))
    assert [
        name for name in ("hp/test_acc", "hp/val_acc", *EFFECTIVE_BATCH_METRICS) if name in content
    ] == declared
    assert events.Tags()["scalars"] == []


def test_the_confusion_matrix_of_many_classes_is_a_picture_of_a_fixed_size():
    """A count in every cell of a figure growing with the classes: 6.4 GB at 200 classes."""
    names = [f"class {number}" for number in range(200)]
    matrix = torch.randint(0, 5, (200, 200))
    figure = confusion_figure(matrix, names)
    assert tuple(figure.get_size_inches()) == (8, 7) and not figure.axes[0].texts
    shares = figure.axes[0].images[0].get_array()
    np.testing.assert_allclose(shares.sum(1), np.ones(200), rtol=1e-5)
    few = confusion_figure(torch.eye(3, dtype=torch.long), names[:3])
    assert len(few.axes[0].texts) == 9  # torchmetrics' plot, a count in each cell


def test_class_names_are_drawn_as_written():
    """A class `$5_$10` (math text to matplotlib) and a folder name that is not UTF-8 ended
    the run at its first validation."""
    names = ["$5_$10", "caf\udce9", "under_$5"]
    images = [np.zeros((8, 8, 3), np.uint8)] * 3
    predictions = predictions_figure(images, names, names[::-1])
    for figure in (predictions, confusion_figure(torch.eye(3, dtype=torch.long), names)):
        FigureCanvasAgg(figure).draw()
    assert predictions.axes[0].get_title() == "\\$5_\\$10\n(true: under_\\$5)"  # drawn as $5_$10
    assert predictions.axes[1].get_title().startswith("caf?\n")


def three_images_in_a_batch() -> tuple[list[np.ndarray], PackedBatch]:
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 256, (h * 8, w * 8, 3), dtype=np.uint8) for h, w in [(2, 5), (4, 1), (3, 3)]]
    samples = [image_to_sample(Image.fromarray(p), label, 8, 64) for label, p in enumerate(pictures)]
    return pictures, pack(samples, PackedShape(rows=2, row_len=16, max_images=4), 8 * 8 * 3)


class Guesser:
    """A module that predicts the true class of its first image and a wrong one for the rest."""

    net = SimpleNamespace(patch_size=8)

    def __call__(self, batch: PackedBatch, index: torch.Tensor) -> torch.Tensor:
        true = batch.labels.flatten()[index]
        return torch.nn.functional.one_hot((true + (torch.arange(len(index)) > 0)) % 3, 3).float()


def test_validation_pictures_title_the_first_images_with_their_predicted_and_true_class(monkeypatch):
    pictures, batch = three_images_in_a_batch()
    drawn = []
    monkeypatch.setattr(
        "navit_lightning.pictures.log_figure",
        lambda loggers, tag, figure, step: drawn.append((tag, figure, step)),
    )
    trainer = SimpleNamespace(
        is_global_zero=True,
        loggers=[object()],
        sanity_checking=True,
        precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext),
        datamodule=SimpleNamespace(class_names=lambda: ["a", "b", "c"]),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=7)),
        global_step=8,
    )
    callback = LogPictures(images=2)
    callback.setup(trainer, Guesser(), "fit")
    callback.on_validation_batch_end(trainer, Guesser(), None, batch, 0)  # the sanity check's
    trainer.sanity_checking = False
    callback.on_validation_batch_end(trainer, Guesser(), None, batch, 1)  # not the first batch
    callback.on_validation_batch_end(trainer, Guesser(), None, batch, 0)
    ((tag, figure, step),) = drawn
    assert tag == "pictures/val_predictions" and step == 7  # the step of the validation's scalars
    true = batch.labels.flatten()[image_index(batch)].tolist()
    assert len(figure.axes) == 2  # LogPictures(images=2)
    for axes, label, (guess, colour) in zip(
        figure.axes, true[:2], [(true[0], "green"), ((true[1] + 1) % 3, "red")], strict=True
    ):
        assert (
            axes.get_title() == f"{'abc'[guess]}\n(true: {'abc'[label]})" and axes.title.get_color() == colour
        )
        np.testing.assert_array_equal(axes.images[0].get_array(), pictures[label])


def test_predictions_take_as_many_rows_as_their_images_need():
    images = [np.zeros((8, 8, 3), np.uint8)] * 7
    assert len(predictions_figure(images, ["a"] * 7, ["a"] * 7, columns=6).axes) == 7


def test_each_logger_that_shows_pictures_gets_the_figure_at_its_step():
    """MLflow keeps one artifact per file name: each step's figure needs its own."""
    tensorboard, mlflow, wandb = (
        MagicMock(spec=kind) for kind in (TensorBoardLogger, MLFlowLogger, WandbLogger)
    )
    figure = Figure()
    log_figure([tensorboard, mlflow, wandb, MagicMock(spec=CSVLogger)], "pictures/x", figure, 5)
    tensorboard.experiment.add_figure.assert_called_once_with(
        "pictures/x", figure, global_step=5, close=False
    )
    mlflow.experiment.log_figure.assert_called_once_with(mlflow.run_id, figure, "pictures/x_5.png")
    wandb.log_image.assert_called_once_with(key="pictures/x", images=[figure], step=5)
