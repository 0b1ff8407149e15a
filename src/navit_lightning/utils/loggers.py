"""Loggers that the configs name in place of Lightning's own."""

from __future__ import annotations

import csv
import os
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from navit_lightning.utils.instantiate import absolute_path, instantiate_group

if TYPE_CHECKING:
    from mlflow import MlflowClient


def instantiate_loggers(config: DictConfig | None) -> list[Logger]:
    """The loggers of the logger group. A W&B logger's folder becomes WANDB_DIR: the ranks
    that ddp_spawn starts attach to its run and write the run's files (the pictures) under
    WANDB_DIR, by default the working directory, where they were lost to the run folder."""
    loggers = instantiate_group(config)
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger.save_dir:
            os.environ["WANDB_DIR"] = os.path.abspath(logger.save_dir)
    return loggers


class AppendingExperimentWriter(ExperimentWriter):
    """Adds rows under an existing metrics.csv's header, where Lightning's writer deletes the
    file when it starts (it warns "Previous log files ... will be deleted"). The header is read
    at each save: another copy of the writer may have written the file since (ddp_spawn hands
    each stage a copy of the launching process's, which saw none of the fit's columns), and a
    new column rewrote the file with this copy's columns alone, failing on the others' rows
    after emptying it."""

    def _check_log_dir_exists(self) -> None:
        pass

    def save(self) -> None:
        if self.metrics and self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                header = next(csv.reader(file), [])
            self.metrics_keys = sorted({*header, *self.metrics_keys})  # sorted, as Lightning keeps them
        super().save()


class ResumableCSVLogger(CSVLogger):
    """A CSVLogger whose metrics.csv a resumed run adds to (ckpt_path=last in the run's own
    folder), instead of starting it anew. Steps logged after the last checkpoint and before
    the stop appear twice: the resumed run logs them again."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment


# ckpt_path, and this logger's setting that follows it
RESUME_SETTINGS = ("ckpt_path", "resume_from")


class ResumableMLFlowLogger(MLFlowLogger):
    """An MLFlowLogger that goes on with the MLflow run already logging its run folder (the
    run whose `run_dir` tag is this one's) when the command resumes from that folder's own
    checkpoint (`resume_from`: ckpt_path=last, a requeued SLURM job), as TensorBoard and CSV go
    on in the folder's files, where Lightning's starts another run. A fresh start in a reused
    folder, or an evaluation of another run's checkpoint, starts a run of its own. MLflow keeps
    a param's first value: a setting changed since (trainer.max_epochs=16 on resume) keeps it
    there, and a line says so. A run taken up and refused before it logged a metric keeps its
    status."""

    def __init__(self, *args: Any, resume_from: str | None = None, **kwargs: Any) -> None:
        run_dir = (kwargs.get("tags") or {}).get("run_dir")
        if kwargs.get("run_name") is None and run_dir:
            # MLflow draws a name from Python's random, which the run's seed sets: every run of
            # a seed had one name. Its folder's: runs/<stamp>, or <sweep stamp>/<job number>
            kwargs["run_name"] = "/".join(Path(run_dir).parts[-2:])
        super().__init__(*args, **kwargs)
        self._resume_from = resume_from
        self._taken_up = False  # an earlier run, to which this start has logged no metric yet

    @property
    @rank_zero_experiment
    def experiment(self) -> MlflowClient:
        if not self._initialized and self._run_id is None and self._resumes_its_folder():
            self._run_id = self._run_logging(str(self.tags["run_dir"]))
            self._taken_up = self._run_id is not None
        return super().experiment

    def _resumes_its_folder(self) -> bool:
        run_dir = (self.tags or {}).get("run_dir")
        if not run_dir or not self._resume_from:
            return False
        if self._resume_from == "last":
            return True
        return Path(absolute_path(run_dir)) in Path(absolute_path(self._resume_from)).parents

    def _run_logging(self, run_dir: str) -> str | None:
        """The newest active run of this logger's experiment tagged with `run_dir`."""
        from mlflow.exceptions import MlflowException

        experiment = self._mlflow_client.get_experiment_by_name(self._experiment_name)
        if experiment is None or experiment.lifecycle_stage == "deleted":
            return None
        quote = '"' if "'" in run_dir else "'"
        try:
            runs = self._mlflow_client.search_runs(
                [experiment.experiment_id],
                filter_string=f"tags.run_dir = {quote}{run_dir}{quote}",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
        except MlflowException:  # a folder's name that MLflow's filter cannot quote: a new run
            return None
        return runs[0].info.run_id if runs else None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        client = self.experiment  # which takes the folder's run up, where one goes on
        if self._taken_up:
            client.update_run(self.run_id, status="RUNNING")
            self._taken_up = False
        super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._taken_up:
            super().finalize(status)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace) -> None:
        # as Lightning's MLFlowLogger stores them
        given = {key: str(value)[:250] for key, value in _flatten_dict(_convert_params(params)).items()}
        kept = self.experiment.get_run(self.run_id).data.params
        changed = {key: value for key, value in given.items() if kept.get(key, value) != value}
        # every resume changes these: a line on them would say nothing
        told = {key: value for key, value in changed.items() if key.rsplit("/", 1)[-1] not in RESUME_SETTINGS}
        if told:
            rank_zero_info(
                f"MLflow run {self.run_id} keeps the params it was started with: "
                + ", ".join(f"{key}={kept[key]} (now {value})" for key, value in told.items())
            )
        super().log_hyperparams({key: value for key, value in given.items() if key not in changed})


def log_run_config(loggers: Sequence[Logger], config: dict[str, Any], results: Sequence[str]) -> None:
    """The run's config into each logger; TensorBoard's HPARAMS tab lists the `results` that
    finish_loggers logs at the end beside it. Lightning's log_hyperparams logs a value for
    each at step 0, a placeholder, which the tab shows as a result where the run gives none:
    a resume refused before its first step left 0.0 as its run's last value there."""
    for logger in loggers:
        logger.log_hyperparams(config)
        if isinstance(logger, TensorBoardLogger) and results:
            _declare_results(logger, config, results)


@rank_zero_only
def _declare_results(logger: TensorBoardLogger, config: dict[str, Any], results: Sequence[str]) -> None:
    from torch.utils.tensorboard.summary import hparams

    # as Lightning's log_hyperparams writes them, less the values (only the names are read)
    params = logger._sanitize_params(_flatten_dict(_convert_params(config)))
    writer = logger.experiment._get_file_writer()
    for summary in hparams(params, dict.fromkeys(results, 0.0)):
        writer.add_summary(summary)


def finish_loggers(trainer: L.Trainer, final: dict[str, float], status: str = "success") -> None:
    """Log `final` at the last step, then close every logger: a CSV logger writes its file
    here, and a W&B run is finished, which Lightning leaves open (the next job of a sweep, in
    the same process, logged into it and overwrote its config)."""
    for logger in trainer.loggers:
        if final:
            logger.log_metrics(final, step=trainer.global_step)
        logger.finalize(status)
        if isinstance(logger, WandbLogger):  # a no-op stand-in on ranks other than 0
            logger.experiment.finish(exit_code=0 if status == "success" else 1)


@contextmanager
def loggers_closed_on_failure(
    trainer: L.Trainer, results: Callable[[], dict[str, float]] = dict
) -> Iterator[None]:
    """A job that fails (a refused resume, an error in fit) closes its loggers too, with its
    `results` so far once it has trained: its open W&B run took the sweep's next job, and
    TensorBoard's HPARAMS showed a stopped run's placeholders, 0.0, as its results (a resume
    refused before its first step logs none over the run's)."""
    try:
        yield
    except BaseException:
        try:
            finish_loggers(trainer, results() if trainer.global_step > 0 else {}, status="failed")
        except Exception as error:  # the full disk that failed the job, most often: its error counts
            why = error.__cause__ or error  # Lightning's ValueError over TensorBoard's OSError
            rank_zero_warn(f"the loggers could not be closed ({type(why).__name__}: {why})")
        raise
