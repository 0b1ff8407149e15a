"""Matplotlib figures of what the project does, and their way into the loggers that show
pictures. Figures are built without pyplot: no display, no global figure state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

if TYPE_CHECKING:
    from navit_lightning.resolution import BudgetResult


def resolution_figure(curves: Mapping[str, Sequence[BudgetResult]]) -> Figure:
    """Accuracy against mean patches per image, one curve per model, each point labelled
    with its patch budget."""
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot()
    for label, results in curves.items():
        patches = [result.patches_per_image for result in results]
        axes.plot(patches, [result.accuracy for result in results], marker="o", label=label)
        for result, x in zip(results, patches, strict=True):
            axes.annotate(
                str(result.patch_budget),
                (x, result.accuracy),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.set_xlabel("mean patches per image (patch budget at each point)")
    axes.set_ylabel("accuracy")
    axes.grid(alpha=0.3)
    axes.legend()
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
