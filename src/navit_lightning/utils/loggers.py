"""Loggers that the configs name in place of Lightning's own."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class AppendingExperimentWriter(ExperimentWriter):
    """Adds rows under an existing metrics.csv's header, where Lightning's writer deletes the
    file when it starts (it warns "Previous log files ... will be deleted")."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                # the columns so far: a new metric rewrites the file with them and itself
                self.metrics_keys = next(csv.reader(file), [])


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
def loggers_closed_on_failure(trainer: L.Trainer) -> Iterator[None]:
    """A job that fails (a refused resume, an error in fit) closes its loggers too: its open
    W&B run took the sweep's next job."""
    try:
        yield
    except BaseException:
        finish_loggers(trainer, {}, status="failed")
        raise
