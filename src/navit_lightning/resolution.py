"""Accuracy across resolutions: one network evaluated with its images scaled to each of
several patch budgets, larger than in training too (NaViT's one model for every
resolution, measured). eval.py runs it on a checkpoint, train.py at the end of training."""

from __future__ import annotations

import argparse
import csv
import gc
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from navit_lightning.pictures import log_figure

RESULTS_NAME = "resolution_accuracy"


@dataclass(frozen=True)
class BudgetResult:
    patch_budget: int
    patches_per_image: float
    accuracy: float
    images_per_s: float


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


class EvalCounter(L.Callback):
    """Per loader of an evaluation (one per patch budget): its images and real tokens, summed
    over its batches and ranks, and its batches' seconds (each from its start to its end,
    summed) on the slowest rank, all through Lightning's logging, which keys them by loader
    where there are several (collectives in its own order: see utils/callbacks.py). Logged,
    not kept here: under ddp_spawn this callback runs in the ranks, a copy of the caller's, and
    only the logged metrics come back."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    # A full garbage collection, due after the start-up and the checkpoint's load, would land
    # in the first timed batch otherwise: 219 ms in a 48-image test step of 22 ms (eval.py on
    # the tests' tiny data), which read as 172 images/s for a budget that runs at 2,000.
    def on_validation_start(self, *args: Any) -> None:
        gc.collect()

    def on_test_start(self, *args: Any) -> None:
        gc.collect()

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._start(*args)

    def on_test_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._start(*args)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._count(pl_module, "val")

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._count(pl_module, "test")

    # The batches' own time, not the loader's: Lightning fetches each batch before the last
    # one runs, the next loader's first among them, so a pass's wall time took a batch's
    # loading from the next budget, and a budget of one batch read as compute alone.
    def _start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 0:  # each loader's first batch
            self.seconds = 0.0
        self.started = time.perf_counter()

    def _count(self, pl_module: L.LightningModule, stage: str) -> None:
        counts = pl_module.batch_counts
        self.seconds += time.perf_counter() - self.started
        # The seconds so far, every batch: their maximum is the loader's whole.
        for name, value, reduce in (
            ("images", counts.images, "sum"),
            ("real_tokens", counts.real_tokens, "sum"),
            ("seconds", self.seconds, "max"),
        ):
            pl_module.log(
                f"{stage}/{name}", float(value), on_epoch=True, reduce_fx=reduce, sync_dist=True, batch_size=1
            )


@contextmanager
def counting(trainer: L.Trainer) -> Iterator[None]:
    """The trainer's evaluations inside the block log their images, tokens and seconds
    (EvalCounter); a fit after it logs none."""
    counter = EvalCounter()
    trainer.callbacks.append(counter)
    try:
        yield
    finally:
        trainer.callbacks.remove(counter)


def accuracy_line(split: str, metrics: Mapping[str, float], evaluated: str) -> str:
    """The one line that states an evaluation's result, from the metrics it logged under
    counting(): its accuracy, on how many images, of which weights."""
    accuracy, images = metrics[f"{split}/acc"], metrics[f"{split}/images"]
    return f"{split} accuracy: {accuracy:.4f} on {images:.0f} images ({evaluated})"


# the Trainer stage that sets a split up, and the Trainer method that runs it
SPLIT_STAGES = {"val": "validate", "test": "test", "predict": "predict"}


def why_no_budget_sweep(model: L.LightningModule, datamodule: Any) -> str | None:
    """Why `model` and `datamodule` (a user's own) cannot evaluate at several patch budgets,
    a loader each; None where they can. Found before a fit: the sweep failed after it."""
    missing = [name for name in ("evaluate_at", "longest_side") if not hasattr(datamodule, name)]
    if missing:
        return f"{type(datamodule).__name__} has no {' or '.join(missing)}, as PackedImageDataModule has"
    if not is_param_in_hook_signature(model.validation_step, "dataloader_idx"):
        return (
            f"{type(model).__name__}.validation_step takes no dataloader_idx (a loader a budget): "
            "add `dataloader_idx: int = 0`"
        )
    return None


def budgets_past_the_tables(
    budgets: list[int | None], datamodule: Any, net: Any, split: str
) -> dict[int | None, str]:
    """Of patch `budgets` (None: data.max_patches), those at which an image of `split` would
    be longer than the network's absolute position tables (model.net.max_grid), each with
    why, naming that image: its evaluation would stop there (under ddp on one rank, which
    the others wait for). Every rank finds the same: from the data's sizes."""
    if not budgets or net.pos_embed.fractional:
        return {}
    datamodule.setup(SPLIT_STAGES[split])  # after a fit a no-op, but in ddp_spawn's first process
    longest = {budget: datamodule.longest_side(split, budget) for budget in budgets}
    images = "input" if split == "predict" else split
    return {
        budget: f"{images} image {image} is {length} patches long, past model.net.max_grid="
        f"{net.pos_embed.max_grid} (the network's position tables)"
        for budget, (length, image) in longest.items()
        if length > net.pos_embed.max_grid
    }


def budgets_that_fit(budgets: list[int], datamodule: Any, net: Any, split: str) -> list[int]:
    """`budgets` but those past the position tables, named in a warning: train.py's sweep
    after a whole fit leaves them out rather than fail there."""
    too_long = budgets_past_the_tables(budgets, datamodule, net, split)
    if too_long:
        first = next(iter(too_long))
        rank_zero_warn(
            f"patch_budgets {list(too_long)} left out: at {first} {too_long[first]}; fractional "
            "positions have no such bound"
        )
    return [budget for budget in budgets if budget not in too_long]


def accuracy_across_budgets(
    trainer: L.Trainer,
    model: L.LightningModule,
    datamodule: Any,
    budgets: list[int],
    split: str,
    ckpt_path: str | None = None,
) -> list[BudgetResult]:
    """Evaluate `split` once, with a loader per patch budget, each image at its own aspect
    ratio scaled to at most that many patches; `ckpt_path`, if given, is loaded first. One
    evaluation for all budgets: under ddp_spawn every evaluation starts the ranks anew."""
    run_split = getattr(trainer, SPLIT_STAGES[split])
    # The per-budget metrics stay out of the run's loggers (they would log at step 0):
    # report() logs them with the budget as the step.
    loggers, trainer.loggers = trainer.loggers, []
    try:
        datamodule.evaluate_at(budgets)
        with counting(trainer):
            run_split(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    finally:
        datamodule.evaluate_at(None)
        trainer.loggers = loggers
    results, counts = [], []
    for index, budget in enumerate(budgets):
        # Lightning's key for a loader's metric, where there are several
        suffix = f"/dataloader_idx_{index}" if len(budgets) > 1 else ""
        images, real_tokens, accuracy, seconds = (
            float(trainer.callback_metrics[f"{split}/{name}{suffix}"])
            for name in ("images", "real_tokens", "acc", "seconds")
        )
        result = BudgetResult(budget, real_tokens / max(images, 1.0), accuracy, images / max(seconds, 1e-9))
        rank_zero_info(
            f"{split} at patch budget {budget:>4}: {result.patches_per_image:6.1f} patches per image, "
            f"accuracy {result.accuracy:.4f} on {images:.0f} images, {result.images_per_s:,.0f} images/s"
        )
        results.append(result)
        counts.append(round(images))
    if len(set(counts)) > 1:  # a batch holds fewer images at a larger budget
        rank_zero_warn(
            f"the patch budgets {budgets} scored {counts} images: trainer.limit_{split}_batches (or "
            "fast_dev_run, overfit_batches, debug=limit in training) limits each budget's batches, "
            "so the curve compares other images at each budget"
        )
    return results


def report(results: list[BudgetResult], trainer: L.Trainer, folder: Path, title: str) -> None:
    """Write `resolution_accuracy.csv` and `.png` into `folder` and log the figure and the
    accuracy per budget (as the step) to the trainer's loggers; on global rank zero only."""
    if not trainer.is_global_zero:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{RESULTS_NAME}.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([field.name for field in fields(BudgetResult)])
        writer.writerows(astuple(result) for result in results)
    figure = resolution_figure({title: results})
    figure.savefig(folder / f"{RESULTS_NAME}.png", dpi=120)
    for logger in trainer.loggers:
        for result in results:
            logger.log_metrics(
                {"resolution/acc": result.accuracy, "resolution/patches_per_image": result.patches_per_image},
                step=result.patch_budget,
            )
    log_figure(trainer.loggers, "resolution/accuracy", figure, trainer.global_step)
    rank_zero_info(f"accuracy across resolutions: {folder / RESULTS_NAME}.csv and .png")


def read_results(path: Path) -> list[BudgetResult]:
    """The rows of a `resolution_accuracy.csv`."""
    with open(path, newline="") as file:
        return [
            BudgetResult(int(row["patch_budget"]), *(float(row[f.name]) for f in fields(BudgetResult)[1:]))
            for row in csv.DictReader(file)
        ]


def label_and_path(curve: str) -> tuple[str, str]:
    """LABEL=CSV split at the first "=" (a path may hold more: Hydra names sweep folders like
    optimizer.lr=1e-3), or CSV alone, labelled by its folder (the run's, or the sweep job's)."""
    if Path(curve).is_file() or "=" not in curve:
        return Path(curve).parent.name, curve
    label, path = curve.split("=", 1)
    return label, path


def main(argv: list[str] | None = None) -> None:
    """python -m navit_lightning.resolution LABEL=<run>/resolution_accuracy.csv ... --out F.png:
    the curves of several runs in one figure (e.g. variable against fixed resolution)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("curves", nargs="+", metavar="[LABEL=]CSV")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = args.out.suffix.lstrip(".").lower()
    if kind and kind not in kinds:  # no suffix: matplotlib writes a png
        endings = ", .".join(kinds)
        parser.error(f"--out {args.out}: matplotlib writes no .{kind} file; end it in one of .{endings}")
    curves = {}
    for curve in args.curves:
        label, path = label_and_path(curve)
        if not Path(path).is_file():
            parser.error(f"{path} is not a file: give LABEL=<run>/resolution_accuracy.csv or the file alone")
        if label in curves:  # job 0 of two sweeps: one curve would replace the other
            parser.error(f"two curves are labelled {label!r}: name each, LABEL=CSV")
        try:
            curves[label] = read_results(Path(path))
        except (KeyError, ValueError) as error:
            parser.error(f"{path} is not a resolution_accuracy.csv of train.py or eval.py ({error!r} in it)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    resolution_figure(curves).savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
