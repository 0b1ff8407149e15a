"""strategy=ddp and ddp_spawn under Hydra.

Lightning's ddp launcher starts ranks 1.. as `python <sys.argv> hydra.run.dir=<run dir>`.
In a multirun sweep sys.argv holds `-m` and the whole sweep, so every child starts a sweep
of its own in another folder (Lightning issue 11300). Here the children get this job's own
overrides and its output folder, and leave the .hydra folder and the log file to rank 0.

ddp_spawn's processes start with Python's default logging, so what rank 0 logs during fit
would miss the run's log file: they get the job's logging config back, the launching
process's float32 matmul precision (train.py's TF32) and its warning filters, which
Lightning does not carry over. Every rank also sets torchmetrics' rank-zero flag, which
Lightning leaves at what torchmetrics read from LOCAL_RANK.

Every process destroys its process group at exit: Lightning does so for NCCL only, and a
gloo group left to the interpreter's exit aborts a process now and then ("terminate called
without an active exception", SIGABRT; 2 of 40 spawned pairs in a plain torch script, 0 of
120 once destroyed), failing a ddp_spawn run between two of its stages.

Every rank waits at most `startup_timeout_s` for the others to join (torchrun's join timeout),
then at most `collective_timeout_s` in a collective (torch's default: 30 minutes), and ends
within seconds of SIGTERM/SIGINT (utils/shutdown.py). Lightning gives torch one timeout for
both, so a short collective timeout failed runs whose ranks took longer than it to start.
"""

from __future__ import annotations

import atexit
import logging.config
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import torch
import torch.distributed
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from omegaconf import OmegaConf
from torch.distributed.distributed_c10d import _set_pg_timeout
from torchmetrics.utilities.prints import rank_zero_only as torchmetrics_rank_zero_only

import __main__
from navit_lightning.errors import ConfigError
from navit_lightning.utils.entry_point import refusal, tidy_lightning_output
from navit_lightning.utils.launch import in_sweep, quiet_overrides, torchrun_agent_store
from navit_lightning.utils.shutdown import end_promptly_on_signals

# Hydra settings a rank's command sets below, in place of the parent's (hydra.mode=MULTIRUN
# in a sweep's job)
RANK_HYDRA_SETTINGS = (
    "hydra.mode",
    "hydra.run.dir",
    "hydra.job.name",
    "hydra.output_subdir",
    "hydra.job_logging",
)


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command line and working directory that rerun the current Hydra job as `local_rank`:
    its config folders (--config-path, --config-dir), its hydra.* settings (a searchpath of
    more config groups) and its overrides."""
    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += ["--config-name", hydra_cfg.job.config_name]
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "main" and source.schema == "file":  # hydra.main's, or --config-path
            command += ["--config-path", source.path]
        if source.provider == "command-line":  # a --config-dir given to the parent
            command += ["--config-dir", source.path.removeprefix("file://")]
    command += [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(RANK_HYDRA_SETTINGS)]
    command += list(hydra_cfg.overrides.task)
    output_dir = Path(hydra_cfg.runtime.output_dir).as_posix()
    command += [f'hydra.run.dir="{output_dir}"', f"hydra.job.name=train_ddp_process_{local_rank}"]
    # a single run even where the config asks for a sweep (hparams_search sets hydra.mode):
    # the job's overrides hold the trial's values, which every rank must train
    command += ["hydra.mode=RUN"]
    command += quiet_overrides(command)
    return command, get_original_cwd()


class _HydraJobLauncher(subprocess_script._SubprocessScriptLauncher):
    """Where a stage failed in the launching process, ranks 1.. end with it, `grace_s` after
    its exit to end of their own first: a rank stuck outside any collective (a loader worker
    hung on a file system that stopped answering) outlived its rank 0, which had ended on the
    collective it never entered, for good, holding its GPU and its loader processes. After a
    run that went well they finish their own work, as under torchrun."""

    grace_s = 30.0

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(subprocess_script, "_launch_process_observer", _observe_job_ranks):
            try:
                return super().launch(function, *args, **kwargs)
            except BaseException:
                atexit.register(end_processes, self.procs, self.grace_s)
                raise

    def _call_children_scripts(self) -> None:
        with mock.patch.object(subprocess_script, "_hydra_subprocess_cmd", hydra_job_command):
            super()._call_children_scripts()


class _JobRankObserver(_ChildProcessObserver):
    """Lightning's watch over ranks 1..: once one fails, it kills them and, at once, the
    launching process, rank 0, where it would wait in a collective. Rank 0 now gets
    `grace_s` to end with its own line first (the lost peer, its own timeout): killed, it
    said nothing and exited -9. In a sweep the launching process runs the sweep, and the
    watch, outliving its job, killed it during a later job: there rank 0 is left to fail
    its job on the lost peer."""

    grace_s = 10.0

    def __init__(self, child_processes: list[subprocess.Popen], in_sweep: bool) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=child_processes)
        self._in_sweep = in_sweep

    def _terminate_all(self) -> None:
        for process in self._child_processes:
            process.send_signal(self._termination_signal)
        if not self._in_sweep:
            time.sleep(self.grace_s)  # a daemon thread: gone with the process if it ends
            os.kill(self._main_pid, self._termination_signal)


def _observe_job_ranks(child_processes: list[subprocess.Popen]) -> None:
    _JobRankObserver(child_processes, in_sweep()).start()


class _HydraLoggingSpawnLauncher(_MultiProcessingLauncher):
    def __init__(self, strategy: DDPStrategy, start_method: str) -> None:
        super().__init__(strategy, start_method=start_method)
        self._job_logging = OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        # Lightning hands its ranks its own global state only (_GlobalStateSnapshot): without
        # this they would run float32 matmuls without the TF32 that train.py asks for, and
        # show the warnings that the entry point silenced (eval.py's, predict.py's)
        self._float32_matmul_precision = torch.get_float32_matmul_precision()
        self._warning_filters = list(warnings.filters)
        return super().launch(function, *args, **kwargs)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        torch.set_float32_matmul_precision(self._float32_matmul_precision)
        warnings.filters[:] = self._warning_filters
        job_logging = dict(self._job_logging)
        if process_idx > 0:  # the console only: the log file is rank 0's
            job_logging["handlers"] = {k: v for k, v in job_logging["handlers"].items() if k != "file"}
            job_logging["root"] = {**job_logging["root"], "handlers": ["console"]}
        logging.config.dictConfig(job_logging)
        tidy_lightning_output()
        end_promptly_on_signals()
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        except Exception as error:
            # torch hands the launching process a rank's error as its traceback's text: a
            # refusal goes as a ConfigError of its one line, which refusal() reads back there.
            message = refusal(error)
            if message is None:
                raise
            raise ConfigError(message) from None

    def get_extra_results(self, trainer: L.Trainer) -> dict[str, Any]:
        return {**super().get_extra_results(trainer), "fit_loop": trainer.fit_loop.state_dict()}

    def update_main_process_results(self, trainer: L.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        # the launching process logs the test's metrics and hp/*, at the step
        # its ranks trained to (they were at step 0)
        trainer.fit_loop.load_state_dict(extra["fit_loop"])


class HydraDDPStrategy(DDPStrategy):
    """DDPStrategy whose ranks run as the current Hydra job: `popen` children rerun the job
    (also in multirun), `spawn` processes log as the job does; joining takes at most
    `startup_timeout_s`, and a collective that waits longer than `collective_timeout_s` fails."""

    def __init__(
        self, collective_timeout_s: float = 300.0, startup_timeout_s: float = 600.0, **kwargs: Any
    ) -> None:
        super().__init__(timeout=timedelta(seconds=startup_timeout_s), **kwargs)
        self.collective_timeout_s = collective_timeout_s
        self.startup_timeout_s = startup_timeout_s

    def set_world_ranks(self) -> None:
        super().set_world_ranks()  # sets Lightning's two rank-zero flags
        # torchmetrics keeps a third, read from LOCAL_RANK once at import: 0 in every spawned
        # rank and in every node's first, which all printed its rank-zero warnings.
        torchmetrics_rank_zero_only.rank = self.global_rank

    def setup_distributed(self) -> None:
        on_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if on_agent_store and not torch.distributed.is_initialized():  # joined in an earlier stage
            self._join_under_this_starts_prefix()
        super().setup_distributed()  # Lightning's: joins the group, where not joined above
        # torch has no public way to set a process group's timeout after it was created
        _set_pg_timeout(timedelta(seconds=self.collective_timeout_s))
        atexit.unregister(_destroy_process_group)  # once per process, however many stages
        atexit.register(_destroy_process_group)

    def _join_under_this_starts_prefix(self) -> None:
        """torchrun's agent keeps one store for the worker groups it restarts (--max-restarts):
        a restarted group read the last one's gloo addresses there and failed to connect
        ("Gloo connectFullMesh failed", torch issue 135712). Each start joins under its own
        prefix, as torch did before it shared the agent's store."""
        self.set_world_ranks()
        agent_store = torchrun_agent_store(self._timeout)
        torch.distributed.init_process_group(
            self._get_process_group_backend(),
            store=torch.distributed.PrefixStore(
                f"start_{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent_store
            ),
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = _HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        elif HydraConfig.initialized():
            self._launcher = _HydraLoggingSpawnLauncher(self, self._start_method)


def end_processes(processes: list[subprocess.Popen], grace_s: float, stop_s: float = 10.0) -> None:
    """Wait up to `grace_s` for `processes` to end, then stop the rest: SIGTERM (they save
    and end within seconds, see utils/shutdown.py), and SIGKILL after `stop_s` more."""
    wait_for(processes, grace_s)
    for stop in (subprocess.Popen.terminate, subprocess.Popen.kill):
        alive = [process for process in processes if process.poll() is None]
        for process in alive:
            stop(process)
        wait_for(alive, stop_s)


def wait_for(processes: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
