"""Loggers that the configs name in place of Lightning's own."""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
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
