"""Hydra entry point for training: python train.py [overrides] (see configs/train.yaml)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf, open_dict

from navit_lightning import CONFIG_DIR
from navit_lightning.data.datamodule import EFFECTIVE_BATCH_METRICS, PackedImageDataModule
from navit_lightning.data.sampler import refuse_other_ranks
from navit_lightning.errors import ConfigError
from navit_lightning.lit_module import NaViTClassifier
from navit_lightning.resolution import (
    accuracy_across_budgets,
    accuracy_line,
    budgets_that_fit,
    counting,
    report,
    why_no_budget_sweep,
)
from navit_lightning.utils.callbacks import StoreRunConfig
from navit_lightning.utils.checkpoints import (
    CKPT_PATH_EXAMPLE,
    BestCheckpoint,
    check_resumable,
    load_initial_weights,
    resume_epoch_ends_as_ended,
)
from navit_lightning.utils.entry_point import launch, log_config, quiet_lightning_warnings, run_task
from navit_lightning.utils.instantiate import (
    absolute_path,
    instantiate_datamodule,
    instantiate_group,
    switched_on,
)
from navit_lightning.utils.loggers import (
    finish_loggers,
    instantiate_loggers,
    log_run_config,
    loggers_closed_on_failure,
)
from navit_lightning.utils.shutdown import (
    StopTogetherOnSigterm,
    explain_collective_failure,
    requeue_when_asked,
)
from navit_lightning.utils.validate import check_launch, check_monitors

# The run's results beside its settings (TensorBoard's HPARAMS tab): hp/ name -> (metric,
# the config switch of the stage that gives it). Only those the run gives are declared: the
# others would show their placeholder, 0.0, as the run's result.
HP_METRICS = {"hp/val_acc": ("val/acc_best", "train"), "hp/test_acc": ("test/acc", "test")}


def declared_results(cfg: DictConfig) -> list[str]:
    return [name for name, (_, switch) in HP_METRICS.items() if cfg.get(switch)]


def build(
    cfg: DictConfig, extra_callbacks: Sequence[L.Callback] = ()
) -> tuple[L.LightningDataModule, L.LightningModule, L.Trainer]:
    """The datamodule, model and trainer that `cfg` describes (the trainer with the config's
    callbacks and loggers, then `extra_callbacks`)."""
    quiet_lightning_warnings()  # for a notebook's build: train.py's run_task has done it already
    check_launch(cfg)
    # quiet: the printed config holds the seed, and its line came before a refusal's own
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")
    if cfg.data.get("root") is not None:
        with open_dict(cfg):  # as the checkpoints store it: eval.py elsewhere reads the same folder
            cfg.data.root = absolute_path(cfg.data.root)
    datamodule = instantiate_datamodule(cfg.data)
    with open_dict(cfg):
        cfg.model.num_classes = datamodule.num_classes
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    if not isinstance(model, NaViTClassifier):
        raise ConfigError(
            f"model._target_={cfg.model._target_} is no NaViTClassifier: the callbacks and the "
            "end-of-fit sweep read what it keeps (its network, batch counts, best accuracy); "
            "subclass navit_lightning.lit_module.NaViTClassifier and override its steps"
        )
    run_config = OmegaConf.to_container(cfg, resolve=True)
    callbacks = [
        *switched_on(cfg.trainer, instantiate_group(cfg.get("callbacks"))),
        StoreRunConfig(run_config, datamodule.class_names()),
        StopTogetherOnSigterm(),
        *extra_callbacks,
    ]
    if cfg.train:
        # what the model logs, and the callbacks that say what they log
        logged = [
            part.monitorable_metrics() for part in (model, *callbacks) if hasattr(part, "monitorable_metrics")
        ]
        validates = cfg.trainer.get("limit_val_batches") != 0
        check_monitors(cfg.get("callbacks"), set().union(*logged), validates)
    loggers = instantiate_loggers(cfg.get("logger"))
    # Without a checkpoint callback (callbacks=none) Lightning adds one of its own, into the
    # logger's folder, where ckpt_path=last does not look
    checkpointing = cfg.trainer.get("enable_checkpointing")
    if checkpointing is None:
        checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in callbacks)
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, enable_checkpointing=checkpointing
    )
    declared = declared_results(cfg) + (list(EFFECTIVE_BATCH_METRICS) if cfg.get("train") else [])
    log_run_config(trainer.loggers, run_config, declared)
    return datamodule, model, trainer


def resume_from(ckpt_path: str | None, trainer: L.Trainer) -> str | None:
    """The checkpoint file to resume from. ckpt_path=last: the newest last checkpoint, as
    Lightning picks it; before the run folder has one (a first start, which the same command
    resumes later) None, said in one line: Lightning's own warning would advise a
    save_last=True that the config already sets."""
    if ckpt_path != "last":
        return ckpt_path
    lasts = {
        Path(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
        for callback in trainer.checkpoint_callbacks
        if callback.save_last and callback.dirpath
    }
    if not lasts:  # it started afresh, its logs over the run's in a folder that had one
        raise ConfigError(
            "ckpt_path=last resumes the last checkpoint that this run's callbacks save, and none "
            "saves one (callbacks=none, trainer.enable_checkpointing=false): name the file, "
            f"ckpt_path={CKPT_PATH_EXAMPLE}"
        )
    existing = [last for last in lasts if last.is_file()]
    if existing:
        return str(max(existing, key=lambda last: last.stat().st_mtime))
    # a warning: a run folder named wrong (or left out) trains from scratch, exit code 0
    rank_zero_warn(
        f"ckpt_path=last: no last checkpoint ({' or '.join(map(str, sorted(lasts)))}): starting afresh "
        "(a run resumes in its own folder: hydra.run.dir=logs/train/runs/<run>)"
    )
    return None


def hold_out_as_its_run(datamodule: PackedImageDataModule, trainer: L.Trainer, run_data: dict) -> None:
    """Hold out the images that the run of a resumed checkpoint held out, whatever split this
    config asks for (`run_data`: the checkpoint's data config), and say so in the checkpoints
    this run writes: they stored the command's split, which eval.py tested by, on trained
    images, and a later resume trained by."""
    held_out = datamodule.hold_out_as(run_data)
    for store in (callback for callback in trainer.callbacks if isinstance(callback, StoreRunConfig)):
        store.config["data"].update(held_out)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit (and optionally test) the model that `cfg` describes; returns the final metrics."""
    datamodule, model, trainer = build(cfg)
    metrics: dict[str, float] = {}  # as fit and test give them: a failure after reports them
    with loggers_closed_on_failure(
        trainer, lambda: results(cfg, metrics or metrics_so_far(cfg, trainer, model))
    ):
        fit_and_test(cfg, datamodule, model, trainer, metrics)
    finish_loggers(trainer, results(cfg, metrics))
    return metrics


def results(cfg: DictConfig, metrics: dict[str, float]) -> dict[str, float]:
    """The run's declared results (HP_METRICS) in `metrics`; NaN for one it did not give
    (trainer.max_steps ended it before its first validation, it failed or was stopped before
    its test): its placeholder, 0.0, would read as the result."""
    return {name: metrics.get(HP_METRICS[name][0], math.nan) for name in declared_results(cfg)}


def metrics_so_far(cfg: DictConfig, trainer: L.Trainer, model: NaViTClassifier) -> dict[str, float]:
    """What the run has logged, with the best val/acc the model holds where no validation
    logged it since a resume (of a fit that had ended, a stop in its test; or one stopped
    before its first validation): the checkpoint's, which hp/val_acc and a sweep's
    optimized_metric need."""
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if cfg.train and "val/acc_best" not in metrics and model.val_acc_best.max_value.isfinite():
        metrics["val/acc_best"] = float(model.val_acc_best.max_value)
    return metrics


def fit_and_test(
    cfg: DictConfig,
    datamodule: L.LightningDataModule,
    model: L.LightningModule,
    trainer: L.Trainer,
    metrics: dict[str, float],
) -> None:
    """train()'s work between building and closing the loggers, its results into `metrics`."""
    log_config(cfg)
    rank_zero_info(
        f"world size {trainer.world_size} ({trainer.num_nodes} node(s) x {trainer.num_devices} device(s))"
    )
    budgets = list(cfg.get("patch_budgets") or [])
    if budgets and (why := why_no_budget_sweep(model, datamodule)):
        rank_zero_warn(f"patch_budgets skipped: {why}")
        budgets = []
    averaged = any(isinstance(c, WeightAveraging) for c in trainer.callbacks)  # callbacks=ema
    ckpt_path = start_from(cfg, datamodule, model, trainer, averaged)
    with explain_collective_failure(trainer):
        if cfg.train:
            with requeue_when_asked(trainer):
                trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics.update(metrics_so_far(cfg, trainer, model))
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        # what test and the patch budgets evaluate: the best checkpoint of the fit, or the
        # checkpoint train=false was given
        tested = (best or None) if cfg.train else ckpt_path
        if cfg.test:
            with counting(trainer):
                trainer.test(model, datamodule=datamodule, ckpt_path=tested)
            metrics.update({name: float(value) for name, value in trainer.callback_metrics.items()})
            if "test/acc" in metrics:  # trainer.limit_test_batches=0 tests nothing
                # the average, copied into the model at the fit's end
                weights = "the last weights' average" if averaged else "the last weights"
                rank_zero_info(accuracy_line("test", metrics, tested or weights))
        if budgets and trainer.limit_val_batches == 0:  # its validation would log no accuracy
            rank_zero_warn("patch_budgets skipped: trainer.limit_val_batches=0 evaluates no val batch")
            budgets = []
        budgets = budgets_that_fit(budgets, datamodule, model.net, "val")
        if budgets:
            swept = accuracy_across_budgets(trainer, model, datamodule, budgets, "val", tested)
            title = "val" if tested is None else "val, best checkpoint" if cfg.train else f"val, {tested}"
            report(swept, trainer, Path(cfg.paths.output_dir), title)


def start_from(
    cfg: DictConfig,
    datamodule: L.LightningDataModule,
    model: L.LightningModule,
    trainer: L.Trainer,
    averaged: bool,
) -> str | None:
    """The checkpoint the fit resumes (or train=false tests), checked, with its run's held-out
    images kept; where there is none, init_from's weights loaded into `model`."""
    ckpt_path = resume_from(cfg.get("ckpt_path"), trainer)
    if not cfg.train and ckpt_path is None:  # ckpt_path=last in a folder without one
        raise ConfigError(f"train=false tests ckpt_path={cfg.ckpt_path}, which names no checkpoint here")
    if ckpt_path is None:
        if cfg.train and cfg.get("init_from") is not None:
            load_initial_weights(model, cfg.model, cfg.init_from, datamodule.class_names())
        return None
    checkpoint = check_resumable(
        model,
        cfg.model,
        ckpt_path,
        averaged,
        datamodule.class_names(),
        fitting=cfg.train,
        seed=cfg.seed,
    )
    resume_epoch_ends_as_ended(trainer)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, BestCheckpoint):
            callback.resuming = True
    if isinstance(datamodule, PackedImageDataModule):
        hold_out_as_its_run(datamodule, trainer, checkpoint["run_config"]["data"])
        position = checkpoint.get(type(datamodule).__qualname__, {}).get("train_position")
        if cfg.train and position:
            refuse_other_ranks(position, trainer.world_size)
    return ckpt_path


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    metrics = run_task(train, cfg)
    return metrics.get(cfg.get("optimized_metric"))


def main() -> None:
    launch(hydra_main)


if __name__ == "__main__":
    main()
