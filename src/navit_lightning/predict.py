"""Hydra entry point for prediction: python predict.py ckpt_path=<run>/checkpoints/last.ckpt
input=<image file or folder>, writing predictions.csv into the run folder."""

from __future__ import annotations

import csv
import hashlib
import io
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import islice
from operator import itemgetter
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from navit_lightning import CONFIG_DIR
from navit_lightning.data.folder import IMAGE_SUFFIXES, image_files_under
from navit_lightning.data.index import SURROGATES, other_files
from navit_lightning.errors import ConfigError, DataError, OutputError, free_space, is_count
from navit_lightning.resolution import budgets_past_the_tables
from navit_lightning.utils.checkpoints import (
    load_training_run,
    numbered_classes,
)
from navit_lightning.utils.entry_point import launch, run_task
from navit_lightning.utils.instantiate import instantiate_group
from navit_lightning.utils.rebuild import build_from_checkpoint, data_for, data_keys_given
from navit_lightning.utils.shutdown import explain_collective_failure
from navit_lightning.utils.validate import check_launch, check_run_attention

# UTF-8 whatever the locale (a Latin-1 one wrote class names in Latin-1, an ASCII one failed
# on them); a file name that is not UTF-8 is written as its bytes
CSV_TEXT: dict[str, Any] = {"encoding": "utf-8", "errors": SURROGATES, "newline": ""}
# about 4 MB pickled a rank, in each round of gathering the predictions on rank zero
ROWS_A_ROUND = 20_000


def image_files(input_path: Path) -> list[Path]:
    """The file itself, or the image files under the folder (recursively, sorted)."""
    if input_path.is_file():
        return [input_path]
    if not input_path.is_dir():
        raise DataError(f"input={input_path} does not exist: pass an image file or a folder of images")
    others: Counter[str] = Counter()
    files = image_files_under(input_path, others)
    if not files:
        raise DataError(
            f"input={input_path} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}), "
            f"searched recursively{f', but {other_files(others)}' if others else ''}: pass a folder of images"
        )
    if others:
        rank_zero_info(f"input={input_path}: {other_files(others)}")
    return files


class PredictionWriter(BasePredictionWriter):
    """Writes `predictions.csv`: one row per image that could be read, in the order of
    `paths`, with its top_k classes and their probabilities. Every rank writes its share to
    a part file as its batches come (nothing piles up in memory); once every rank is done,
    global rank zero gathers their rows and writes the CSV."""

    def __init__(self, path: Path, paths: Sequence[Path], class_names: Sequence[str], top_k: int) -> None:
        super().__init__(write_interval="batch")
        self.path = path
        self.paths = paths
        self.class_names = class_names
        self.top_k = min(top_k, len(class_names))
        self._part: Any = None

    def header(self) -> list[str]:
        ranked = [[f"class_{k}", f"probability_{k}"] for k in range(2, self.top_k + 1)]
        return ["path", "class", "probability", *[name for pair in ranked for name in pair]]

    def _part_path(self, rank: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.rank{rank}.part")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each ddp rank lists the input itself: a folder that changed between the lists (a sync
        # tool writing into it) had images predicted twice or never, and the run exited 0.
        listed = hashlib.sha1("\n".join(map(str, self.paths)).encode(errors=SURROGATES)).hexdigest()
        same = trainer.strategy.reduce_boolean_decision(
            listed == trainer.strategy.broadcast(listed), all=True
        )
        if not same:  # every rank, together
            raise DataError(
                "the ranks listed different files under input= (it changed while they started): "
                "predict a folder that stays as it is, or a copy of it"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._part = open(self._part_path(trainer.global_rank), "w", **CSV_TEXT)  # noqa: SIM115

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: tuple[torch.Tensor, torch.Tensor],
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        numbers, probabilities = (tensor.cpu() for tensor in prediction)
        top = probabilities.topk(self.top_k, dim=-1)
        writer = csv.writer(self._part)
        with written(self._part_path(trainer.global_rank)):
            for number, values, classes in zip(
                numbers, top.values.tolist(), top.indices.tolist(), strict=True
            ):
                ranked = [(self.class_names[c], f"{v:.6f}") for c, v in zip(classes, values, strict=True)]
                writer.writerow(
                    [int(number), self.paths[number], *(item for pair in ranked for item in pair)]
                )
        # Lightning's predict loop keeps every batch's image numbers (for return_predictions),
        # which this writer does without: 190 bytes an image, 1.9 GB a rank for 10 million.
        # It reads a batch's by its index before this call: the list keeps its length.
        sampler = getattr(trainer.predict_dataloaders, "batch_sampler", None)
        seen = getattr(sampler, "seen_batch_indices", None)
        if seen:
            seen[batch_idx] = ()

    def _rows_on_rank_zero(self, trainer: L.Trainer) -> list[tuple[int, str]]:
        """Every rank's rows on global rank zero (none on the others), each as its image's
        number and its CSV line (250 bytes, where a list of its fields took 900). They travel
        through the process group, not the disk: another node's output folder may be its own
        (a node-local PROJECT_ROOT), where rank zero found no part and every row was lost."""
        with open(self._part_path(trainer.global_rank), **CSV_TEXT) as part:
            rows = map(numbered_line, csv.reader(part))
            if trainer.world_size == 1:
                return list(rows)
            gathered: list[tuple[int, str]] = []
            # in rounds: a part gathered at once is held pickled as well, on every rank together
            while True:
                chunk = list(islice(rows, ROWS_A_ROUND))
                chunks: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
                torch.distributed.gather_object(chunk, chunks, dst=0)
                gathered.extend(row for ranks_rows in chunks or [] for row in ranks_rows)
                if not trainer.strategy.reduce_boolean_decision(len(chunk) == ROWS_A_ROUND, all=False):
                    return gathered

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self._part is None:
            return
        if not self._part.closed:  # a failed run leaves no part behind
            with suppress(OSError):  # its buffered rows may not fit (a full disk)
                self._part.close()
        self._part_path(trainer.global_rank).unlink(missing_ok=True)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        part = self._part_path(trainer.global_rank)
        with written(part):
            self._part.close()
        rows = self._rows_on_rank_zero(trainer)  # every rank, together
        part.unlink()
        if not trainer.is_global_zero:
            return
        if not rows:
            raise DataError(f"none of the {len(self.paths)} input file(s) could be decoded (named above)")
        rows.sort(key=itemgetter(0))
        # whole or not there
        partial = self.path.with_name(f".{self.path.name}.partial")
        try:
            with written(self.path):
                with open(partial, "w", **CSV_TEXT) as file:
                    csv.writer(file).writerow(self.header())
                    file.writelines(line for _, line in rows)
                os.replace(partial, self.path)  # a folder in its place
        finally:
            partial.unlink(missing_ok=True)
        said = f"{self.path}: {len(rows)} image(s) predicted"
        if left_out := len(self.paths) - len(rows):
            # a limit on the batches (trainer.limit_predict_batches, fast_dev_run) reads fewer:
            # its files were counted as unreadable
            limited = sum(trainer.num_predict_batches) < len(trainer.predict_dataloaders)
            why = "by trainer.limit_predict_batches or fast_dev_run, and" if limited else "as"
            said += f", {left_out} file(s) left out {why} unreadable (named above)"
        rank_zero_info(said)


def numbered_line(row: list[str]) -> tuple[int, str]:
    """A part's row as its image's number and the predictions.csv line of the rest."""
    line = io.StringIO()
    csv.writer(line).writerow(row[1:])
    return int(row[0]), line.getvalue()


@contextmanager
def written(path: Path) -> Iterator[None]:
    """Writes to `path` inside the block fail with one line that names it (a full disk gave
    three chained tracebacks)."""
    try:
        yield
    except IsADirectoryError:
        raise OutputError(f"{path} is a folder: move it, or predict into another hydra.run.dir") from None
    except OSError as error:
        raise OutputError(
            f"{path} cannot be written ({error.strerror or error}; {free_space(path)}): free space "
            "there, or predict into another hydra.run.dir"
        ) from None


def predict(cfg: DictConfig) -> Path:
    """Predict the classes of the images under cfg.input; returns the predictions.csv path."""
    budget = cfg.get("patch_budget")
    if not is_count(cfg.top_k):
        raise ConfigError(f"top_k={cfg.top_k} is how many classes each image lists: a whole number above 0")
    if budget is not None and not is_count(budget):
        raise ConfigError(
            f"patch_budget={budget} is the most patches an image is scaled to: a whole number above 0, "
            "or null for the training run's data.max_patches"
        )
    check_launch(cfg, training=False)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run, class_names = load_training_run(cfg.ckpt_path)  # a wrong one refused before a long listing
    check_run_attention(cfg, run)
    paths = image_files(Path(cfg.input).expanduser())
    data = data_for(cfg, run, data_keys_given())
    if "generate" in data:  # nothing to generate (a datamodule of one's own may take no such key)
        data = OmegaConf.merge(data, {"generate": None})
    output = Path(cfg.paths.output_dir) / "predictions.csv"
    writer = PredictionWriter(
        output, paths, class_names or numbered_classes(run.model.num_classes), cfg.top_k
    )
    callbacks = [*instantiate_group(cfg.get("callbacks")), writer]
    datamodule, model, trainer = build_from_checkpoint(cfg, run, data, callbacks)
    if trainer.limit_predict_batches == 0:  # Lightning skips the loop: no CSV, no word, exit 0
        raise ConfigError("trainer.limit_predict_batches=0 predicts nothing: leave it out, or give more")
    datamodule.predict_on(paths)
    datamodule.evaluate_at(None if budget is None else [budget])
    too_long = budgets_past_the_tables([budget], datamodule, model.net, "predict")
    if too_long:
        at = f"at patch_budget={budget or datamodule.train_policy.max_patches}"
        raise ConfigError(f"{at} {too_long[budget]}: give a smaller patch_budget")
    with explain_collective_failure(trainer):
        trainer.predict(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, return_predictions=False)
    return output


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="predict")
def hydra_main(cfg: DictConfig) -> None:
    run_task(predict, cfg, from_checkpoint=True)


def main() -> None:
    launch(hydra_main)


if __name__ == "__main__":
    main()
