"""Hydra entry point for evaluation: python eval.py ckpt_path=<run>/checkpoints/last.ckpt
[patch_budgets=[9,16,36,64]]."""

from __future__ import annotations

import warnings
from pathlib import Path

import hydra
import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf, open_dict

from navit_lightning import CONFIG_DIR
from navit_lightning.resolution import accuracy_across_budgets, report
from navit_lightning.utils.checkpoints import read_checkpoint
from navit_lightning.utils.entry_point import (
    prepare_command_line,
    refuse_bad_input,
    tidy_lightning_output,
)
from navit_lightning.utils.instantiate import instantiate_group
from navit_lightning.utils.shutdown import end_promptly_on_signals, explain_collective_failure
from navit_lightning.utils.validate import check_launch


def load_run_config(ckpt_path: str) -> DictConfig:
    """The training config stored in a checkpoint by StoreRunConfig."""
    return OmegaConf.create(read_checkpoint(ckpt_path)["run_config"])


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Accuracy of the checkpoint's network on the chosen split of cfg.data, at each of
    cfg.patch_budgets if given (accuracy across resolutions)."""
    check_launch(cfg, training=False)
    L.seed_everything(cfg.seed, workers=True)
    run = load_run_config(cfg.ckpt_path)
    with open_dict(cfg):
        cfg.model = run.model  # the network must match the weights
        if cfg.get("data") is None:
            cfg.data = run.data
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    loggers = instantiate_group(cfg.get("logger"))
    # no checkpoints written: Lightning would add a ModelCheckpoint of its own
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, logger=loggers or False, enable_checkpointing=False
    )
    run_split = {"val": trainer.validate, "test": trainer.test}
    if cfg.split not in run_split:
        raise ValueError(f"split={cfg.split!r} is unknown: use split=val or split=test")
    if cfg.get("patch_budgets"):
        with explain_collective_failure(trainer):
            results = accuracy_across_budgets(
                trainer, model, datamodule, list(cfg.patch_budgets), cfg.split, cfg.ckpt_path
            )
        report(results, trainer, Path(cfg.paths.output_dir), f"{cfg.split}: {Path(cfg.ckpt_path).name}")
        return {f"{cfg.split}/acc@{result.patch_budget}": result.accuracy for result in results}
    with explain_collective_failure(trainer):
        run_split[cfg.split](model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    rank_zero_info(f"{cfg.split} accuracy: {metrics[f'{cfg.split}/acc']:.4f} ({cfg.ckpt_path})")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def hydra_main(cfg: DictConfig) -> None:
    tidy_lightning_output()
    # about resuming fit with the callbacks that wrote the checkpoint: eval.py does not fit
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    with refuse_bad_input():
        evaluate(cfg)


def main() -> None:
    end_promptly_on_signals()
    prepare_command_line()
    hydra_main()


if __name__ == "__main__":
    main()
