"""Hydra entry point for evaluation: python eval.py ckpt_path=<run>/checkpoints/last.ckpt
[patch_budgets=[9,16,36,64]]."""

from __future__ import annotations

from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from navit_lightning import CONFIG_DIR
from navit_lightning.data import shapes
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.errors import ConfigError
from navit_lightning.resolution import (
    SPLIT_STAGES,
    accuracy_across_budgets,
    accuracy_line,
    budgets_past_the_tables,
    counting,
    report,
    why_no_budget_sweep,
)
from navit_lightning.utils.callbacks import UnreadableImageReport
from navit_lightning.utils.checkpoints import (
    check_same_classes,
    load_training_run,
)
from navit_lightning.utils.entry_point import launch, run_task
from navit_lightning.utils.loggers import finish_loggers, loggers_closed_on_failure
from navit_lightning.utils.rebuild import build_from_checkpoint, data_for, data_keys_given
from navit_lightning.utils.shutdown import explain_collective_failure
from navit_lightning.utils.validate import check_launch, check_run_attention


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Accuracy of the checkpoint's network on the chosen split of cfg.data (without one, the
    training run's data), at each of cfg.patch_budgets if given (accuracy across resolutions)."""
    if cfg.split not in ("val", "test"):
        raise ConfigError(f"split={cfg.split!r} is unknown: use split=val or split=test")
    limit = f"limit_{cfg.split}_batches"
    if cfg.trainer.get(limit) == 0:
        raise ConfigError(
            f"trainer.{limit}=0 evaluates no batch: leave it out for all of them, or give a count or a share"
        )
    check_launch(cfg, training=False)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run, class_names = load_training_run(cfg.ckpt_path)
    check_run_attention(cfg, run)
    given = data_keys_given()
    data = data_for(cfg, run, given)
    if data.get("generate") and "root" not in given:  # the run's built-in set, maybe made elsewhere
        data.root = shapes.root_for_run(data.root, cfg.paths.data_dir, data.generate)
    datamodule, model, trainer = build_from_checkpoint(cfg, run, data, [UnreadableImageReport()])
    evaluated = OmegaConf.to_container(data, resolve=True)
    if isinstance(datamodule, PackedImageDataModule) and not data.get("evaluate_all"):
        # the images the run never trained on, as a test of it
        evaluated.update(datamodule.hold_out_as(run.data))
    elif data.get("evaluate_all") and "evaluate_all" not in given:
        rank_zero_info(
            f"{data.root} is not the folder the run trained on ({run.data.root}): all its images are "
            "evaluated; a copy or shards of that folder hold out the run's split with data.evaluate_all=false"
        )
    with loggers_closed_on_failure(trainer):
        for logger in trainer.loggers:  # which checkpoint, split and data the figures are of
            logger.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True), "data": evaluated})
        check_same_classes(datamodule.class_names(), class_names, run.model.num_classes, cfg.ckpt_path)
        metrics = scores(cfg, datamodule, model, trainer)
    finish_loggers(trainer, {})
    return metrics


def scores(
    cfg: DictConfig, datamodule: L.LightningDataModule, model: L.LightningModule, trainer: L.Trainer
) -> dict[str, float]:
    """The checkpoint's accuracy on cfg.split, once or at each of cfg.patch_budgets."""
    if cfg.get("patch_budgets"):
        if why := why_no_budget_sweep(model, datamodule):
            raise ConfigError(f"patch_budgets: {why}; or leave patch_budgets out")
        datamodule.prepare_data()  # the run's built-in set may have to be made here first
        too_long = budgets_past_the_tables(list(cfg.patch_budgets), datamodule, model.net, cfg.split)
        if too_long:
            first = next(iter(too_long))
            raise ConfigError(
                f"patch_budgets: at {first} {too_long[first]}: leave out {', '.join(map(str, too_long))}"
            )
        with explain_collective_failure(trainer):
            results = accuracy_across_budgets(
                trainer, model, datamodule, list(cfg.patch_budgets), cfg.split, cfg.ckpt_path
            )
        report(results, trainer, Path(cfg.paths.output_dir), f"{cfg.split}: {Path(cfg.ckpt_path).name}")
        return {f"{cfg.split}/acc@{result.patch_budget}": result.accuracy for result in results}
    # Counted as logged, over every rank: under ddp_spawn this process never sets the data up.
    with explain_collective_failure(trainer), counting(trainer):
        getattr(trainer, SPLIT_STAGES[cfg.split])(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    rank_zero_info(accuracy_line(cfg.split, metrics, cfg.ckpt_path))
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def hydra_main(cfg: DictConfig) -> None:
    run_task(evaluate, cfg, from_checkpoint=True)


def main() -> None:
    launch(hydra_main)


if __name__ == "__main__":
    main()
