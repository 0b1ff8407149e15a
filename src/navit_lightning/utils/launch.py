"""What every process of one multi-process run must agree on before Hydra starts: the run
folder's name, and that only the first process writes the .hydra folder and the log file.

Lightning's ddp launcher starts ranks 1.. itself and tells them the folder (see
strategies/ddp.py). torchrun and SLURM start every process themselves, each running Hydra
on its own: without this, each would name a folder by its own clock and append to the log.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from navit_lightning.errors import space_advice

# Appended to the command line of every process but the first: no second .hydra folder, no
# second writer of the job's log file, <job name>.log (the handler stays configured, but
# never opens the file).
QUIET_RANK_OVERRIDES = (
    "hydra.output_subdir=null",
    "hydra.job_logging.root.handlers=[console]",
    "+hydra.job_logging.handlers.file.delay=true",
)
STAMP_KEY = "navit_lightning/run_stamp"


def srun_tasks() -> int:
    """The tasks of the srun step this process is one of; 0 outside srun. SLURM_STEP_ID is
    srun's alone: SLURM_NTASKS and SLURM_PROCID are the job's in its batch script (sbatch)
    and salloc's shell too, where one process runs, and so is SLURM_NTASKS in the shell of
    salloc's interactive step (SLURM_STEP_NUM_TASKS is the step's)."""
    if "SLURM_STEP_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
        return 0
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", 1)))


def external_launch_rank() -> int | None:
    """This process's global rank when torchrun or SLURM (srun) started several; the node's
    rank of a launch by hand on a node but the first (NODE_RANK=1 python train.py ...: not
    0, which is rank 0's, but quiet as a rank above it); else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return int(os.environ["RANK"])
    if srun_tasks() > 1:
        return int(os.environ["SLURM_PROCID"])
    if int(os.environ.get("NODE_RANK", 0)) > 0:
        return int(os.environ["NODE_RANK"])
    return None


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra sweep (-m): SystemExit would end the sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def resume_overrides() -> str:
    """What resumes this run from its last checkpoint: ckpt_path=last alone starts a new
    run folder, and finds none there."""
    # a config composed in a notebook (compose(), then HydraConfig.set_config) has no run
    # folder of Hydra's: reading it raised MissingMandatoryValue over the error being reported
    output_dir = (
        OmegaConf.select(HydraConfig.get(), "runtime.output_dir") if HydraConfig.initialized() else None
    )
    if output_dir is None:
        return "ckpt_path=last"
    if in_sweep():
        return f"ckpt_path=last hydra.sweep.dir={shlex.quote(HydraConfig.get().sweep.dir)} added to the sweep"
    return f"ckpt_path=last hydra.run.dir={shlex.quote(output_dir)}"


def quiet_rank_overrides() -> list[str]:
    """QUIET_RANK_OVERRIDES for this process's command line, if it is not the first."""
    return quiet_overrides(sys.argv[1:]) if external_launch_rank() else []


def quiet_overrides(arguments: Sequence[str]) -> list[str]:
    """QUIET_RANK_OVERRIDES for a process but the first with these command-line `arguments`,
    but those they hold (a rank Lightning starts on a node but the first: its command has
    them, and NODE_RANK asks for them again; Hydra refuses a `+` setting given twice).
    Their logging ones change the default job logging's handlers: a job logging the command
    chose (hydra/job_logging=stdout, disabled) may have none, and they would fail its start;
    RankZeroLogFile drops the file handler of a torchrun or SLURM task instead."""
    chosen = any(argument.lstrip("+~").startswith("hydra/job_logging=") for argument in arguments)
    return [
        o
        for o in QUIET_RANK_OVERRIDES
        if o not in arguments and not (chosen and o.lstrip("+").startswith("hydra.job_logging"))
    ]


def run_stamp(pattern: str) -> str:
    """The run folder's name (Hydra resolver `run_stamp`): the start time in `pattern`, the same on
    every process of a launch. torchrun: rank 0's clock, shared through the torchrun agent's
    store; SLURM with several tasks: the job and step id; otherwise this process's clock."""
    stamp = datetime.now().strftime(pattern)
    if external_launch_rank() is None:
        return stamp
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _shared_through_torchrun_store(stamp)
    if srun_tasks() > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 0)}"
    return stamp


# configs/hydra/default.yaml names run and sweep folders with it. Cached, as Hydra's `now`:
# a sweep's jobs resolve its folder from copies of one config, and take the first stamp.
OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True, use_cache=True)


def torchrun_agent_store(timeout: timedelta) -> torch.distributed.TCPStore:
    """A client of the store torchrun's agent keeps for the worker groups it starts."""
    return torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )


def _shared_through_torchrun_store(stamp: str) -> str:
    store = torchrun_agent_store(timedelta(minutes=5))
    # Set once: a worker group torchrun restarts (--max-restarts) takes the first one's folder,
    # where ckpt_path=last finds the checkpoint it left (a folder of its own began afresh).
    if int(os.environ["RANK"]) == 0:
        store.compare_set(STAMP_KEY, "", stamp)
    return store.get(STAMP_KEY).decode()


class IsolateJobs(Callback):
    """Hydra callback: each job of a sweep starts from the process state the sweep started
    with. A ddp job leaves its process group and the variables Lightning's launcher set
    (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...): the next job would take itself for a rank
    of the last one and wait for peers that have exited."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._environ = dict(os.environ)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(self._environ)


class UniqueRunFolder(Callback):
    """Hydra callback: a run or a sweep started in the same second as another (a script's
    loop, a job array, two terminals) gets a folder of its own, <stamp>_2, ..., where it shared
    the other's and the two overwrote each other's checkpoints and logs. Only where the clock
    names the folder: not where the command gives hydra.run.dir (a rerun in its folder, ddp's
    ranks 1..), nor a sweep folder a config names (an Optuna study's, which a rerun goes on
    in), nor in a process of a torchrun or SLURM launch (they share their folder's name, see
    run_stamp).

    A run's first process holds its folder for the run's life: a second run given that
    hydra.run.dir while it runs (a resume typed in another terminal, a job array's fixed
    folder) is refused before Hydra writes there; it failed on the first run's checkpoint
    files and mixed both runs' logs. So is a folder of another task's run (eval.py given the
    training run's folder wrote over its .hydra/ config and its resolution_accuracy.csv)."""

    def __init__(self) -> None:
        self.lock: FolderLock | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        given = any(o.startswith("hydra.run.dir=") for o in config.hydra.overrides.hydra)
        if not given and external_launch_rank() is None:
            claim_folder(config.hydra.run, "hydra.run.dir")
        if is_first_process():
            folder = Path(config.hydra.run.dir)
            if given:
                saved = folder / (config.hydra.output_subdir or ".hydra") / "hydra.yaml"
                refuse_another_scripts_folder(folder, saved, config.hydra.job.name)
            self.lock = FolderLock(folder)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.lock is not None:
            self.lock.release()

    # a sweep's job, in its own folder, is held as a run is (the sweep's process runs them in
    # turn; submitit's job processes run one each)
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN and is_first_process():
            self.lock = FolderLock(Path(config.hydra.runtime.output_dir))

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            self.on_run_end(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        clock_named = "${run_stamp:" in OmegaConf.to_container(config.hydra.sweep, resolve=False)["dir"]
        if not clock_named and is_first_process():  # eval.py -m into a training sweep's folder
            folder = Path(config.hydra.sweep.dir)
            refuse_another_scripts_folder(
                folder, folder / "multirun.yaml", config.hydra.job.name, "hydra.sweep.dir"
            )
        if clock_named and external_launch_rank() is None:
            claim_folder(config.hydra.sweep, "hydra.sweep.dir")
            # the launcher composes each job's config again from the overrides
            quoted = config.hydra.sweep.dir.replace("'", "\\'")
            with read_write(config.hydra.overrides):
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir='{quoted}'")


def is_first_process() -> bool:
    """Whether this process starts the run: not a torchrun or SLURM rank above 0, nor a rank
    Lightning's ddp started (LOCAL_RANK above 0; they run in their rank 0's folder)."""
    return not external_launch_rank() and int(os.environ.get("LOCAL_RANK", 0)) == 0


class FolderLock:
    """An exclusive lock on `folder`/.run.lock, the holder's process id in it, until release()
    (which removes the file: the run leaves its folder as it was) or the process's end (a
    killed run holds nothing). Refuses a folder another process holds with one line and exit
    code 2 (Hydra has not started: no traceback to print). Where the file system takes no
    locks (some cluster mounts), nothing is held."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / ".run.lock"
        self.file: TextIO | None = None
        while self.file is None:
            try:  # where Hydra would fail in tracebacks (a log folder not writable, or a file)
                folder.mkdir(parents=True, exist_ok=True)
                file = open(self.path, "a+")  # noqa: SIM115 - held open until release()
            except OSError as error:
                refuse_unwritable(folder, error)
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip() or "unknown"
                file.close()
                refuse_run_folder(
                    folder,
                    f"is in use by another run (process {holder}): give this run a folder of its own, "
                    "or wait for that run to end",
                )
            except OSError:
                file.close()
                return
            if is_at(file, self.path):
                self.file = file
            else:  # its holder removed it as we opened it: lock the one there now
                file.close()
        try:  # unbuffered: a full disk fails here, not again in close()
            os.ftruncate(self.file.fileno(), 0)
            os.pwrite(self.file.fileno(), str(os.getpid()).encode(), 0)
        except OSError as error:  # a full disk: Hydra's traceback when it saved the config
            self.file.close()
            refuse_unwritable(folder, error)
        atexit.register(self.release)  # a run refused in its task ends without on_run_end

    def release(self) -> None:
        atexit.unregister(self.release)
        if self.file is not None:
            self.path.unlink(missing_ok=True)
            self.file.close()
            self.file = None


def refuse_run_folder(folder: Path, why: str, setting: str = "hydra.run.dir") -> NoReturn:
    """One line and exit code 2, before Hydra starts the job (no traceback to print)."""
    print(f"error: {setting}={folder} {why}", file=sys.stderr)
    raise SystemExit(2)


def refuse_another_scripts_folder(
    folder: Path, saved: Path, script: str, setting: str = "hydra.run.dir"
) -> None:
    """Refuses a folder of a run or sweep of another entry point (the hydra.job.name in its
    `saved` config, the script's: train, eval, predict); one of its own, whatever its
    task_name (debug=limit's is debug) or config (--config-name), resumes."""
    try:
        owner = OmegaConf.select(OmegaConf.load(saved), "hydra.job.name")
    except Exception:  # none, or not a config (OSError, YAML's errors): nothing of a run to keep
        return
    if owner is not None and owner != script:
        refuse_run_folder(
            folder,
            f"holds a run of {owner}.py, whose .hydra/ and results {script}.py would write over: give "
            f"it a folder of its own, e.g. {setting}={folder / script}",
            setting,
        )


def refuse_unwritable(folder: Path, error: OSError, setting: str = "hydra.run.dir") -> NoReturn:
    fix = f"{space_advice(error)}give paths.log_dir or {setting} a writable folder"
    why = f"cannot be written ({error.strerror}): {fix}"
    refuse_run_folder(folder, why, setting)


def is_at(file: TextIO, path: Path) -> bool:
    """Whether the open `file` is the one at `path` still (not removed, nor replaced)."""
    try:
        return os.path.samestat(os.fstat(file.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def claim_folder(node: DictConfig, setting: str) -> None:
    """Make node.dir, or the first free <its name>_2, _3, ... beside it, and set node.dir to it."""
    stamped = Path(node.dir)
    folder, number = stamped, 1
    while True:
        try:
            folder.mkdir(parents=True)
            break
        except FileExistsError:
            number += 1
            folder = stamped.with_name(f"{stamped.name}_{number}")
        except OSError as error:
            refuse_unwritable(folder, error, setting)
    with read_write(node):
        node.dir = str(folder)


class RankZeroLogFile(Callback):
    """Hydra callback: a process other than rank 0 of a torchrun/SLURM launch stops writing
    the job's log file. The command line does this for processes Hydra starts from it (see
    QUIET_RANK_OVERRIDES); submitit's tasks run the job without one."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not external_launch_rank():
            return
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            root.removeHandler(handler)
            handler.close()
