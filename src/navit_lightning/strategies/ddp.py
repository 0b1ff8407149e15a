"""strategy=ddp under Hydra: ranks 1.. rerun this job, not the command line.

Lightning's ddp launcher starts ranks 1.. as `python <sys.argv> hydra.run.dir=<run dir>`.
In a multirun sweep sys.argv holds `-m` and the whole sweep, so every child starts a sweep
of its own in another folder (Lightning issue 11300). Here the children get this job's own
overrides and its output folder, and leave the .hydra folder and the log file to rank 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script

import __main__
from navit_lightning.utils.launch import QUIET_RANK_OVERRIDES


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command line and working directory that rerun the current Hydra job as `local_rank`."""
    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += ["--config-name", hydra_cfg.job.config_name]
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "command-line":  # a --config-dir given to the parent
            command += ["--config-dir", source.path.removeprefix("file://")]
    command += list(hydra_cfg.overrides.task)
    output_dir = Path(hydra_cfg.runtime.output_dir).as_posix()
    command += [f'hydra.run.dir="{output_dir}"', f"hydra.job.name=train_ddp_process_{local_rank}"]
    command += QUIET_RANK_OVERRIDES
    return command, get_original_cwd()


class _HydraJobLauncher(subprocess_script._SubprocessScriptLauncher):
    def _call_children_scripts(self) -> None:
        with mock.patch.object(subprocess_script, "_hydra_subprocess_cmd", hydra_job_command):
            super()._call_children_scripts()


class HydraDDPStrategy(DDPStrategy):
    """DDPStrategy whose `popen` launcher reruns the current Hydra job (also in multirun)."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = _HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
