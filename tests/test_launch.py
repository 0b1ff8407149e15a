"""Processes started by torchrun or SLURM agree on one run folder and one log writer."""

import errno
import os
from datetime import datetime, timedelta

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict, read_write

from navit_lightning import CONFIG_DIR
from navit_lightning.utils import launch
from tests.conftest import free_port

PATTERN = "%Y-%m-%d_%H-%M-%S"


def torchrun_env(monkeypatch, rank: int, port: int) -> None:
    for name, value in {
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)


def test_torchrun_ranks_take_rank_zeros_stamp_from_the_agent_store(monkeypatch):
    port = free_port()
    agent_store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    torchrun_env(monkeypatch, rank=0, port=port)
    stamp = launch.run_stamp(PATTERN)
    torchrun_env(monkeypatch, rank=1, port=port)

    class OtherClock:  # rank 1's clock has passed a second boundary, or is off
        @staticmethod
        def now() -> datetime:
            return datetime(2000, 1, 1)

    monkeypatch.setattr(launch, "datetime", OtherClock)
    assert launch.run_stamp(PATTERN) == stamp != "2000-01-01_00-00-00"
    assert launch.quiet_rank_overrides() == list(launch.QUIET_RANK_OVERRIDES)
    # a worker group torchrun restarted (--max-restarts) later: the first one's folder, where
    # ckpt_path=last finds its checkpoint (one of its own started afresh)
    torchrun_env(monkeypatch, rank=0, port=port)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch.run_stamp(PATTERN) == stamp
    del agent_store


def test_slurm_tasks_name_the_run_by_job_and_step(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name, value in {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    assert launch.run_stamp(PATTERN) == "slurm-4242.0"
    assert launch.external_launch_rank() == 3 and launch.quiet_rank_overrides()
    # a sweep's folder too: each task named it by its own clock, and rank 0's jobs went to one
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        hydra_config = compose("train", return_hydra_config=True).hydra
    assert hydra_config.run.dir.endswith("/train/runs/slurm-4242.0")
    assert hydra_config.sweep.dir.endswith("/train/multiruns/slurm-4242.0")


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
        # a SLURM job's batch script: one process, though the job has 4 tasks; runs after each
        # other there shared the folder slurm-<job>.0
        {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},
        # and in salloc's interactive step, a shell srun started with one task
        {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"},
        {"NODE_RANK": "0"},
        {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "1", "RANK": "0"},  # torchrun --nproc_per_node=1
    ],
)
def test_a_lone_process_uses_its_clock_and_writes_everything(monkeypatch, env):
    slurm = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")
    for name in ("TORCHELASTIC_RUN_ID", *slurm, "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch.external_launch_rank() is None and launch.quiet_rank_overrides() == []
    assert len(launch.run_stamp(PATTERN)) == len("2026-01-01_00-00-00")


def test_a_sweep_job_leaves_no_distributed_state_for_the_next(monkeypatch):
    isolate = launch.IsolateJobs()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    isolate.on_job_start(None)
    os.environ["LOCAL_RANK"] = "0"  # what Lightning's ddp launcher sets in the parent
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0
    )
    isolate.on_job_end(None, None)
    assert "LOCAL_RANK" not in os.environ and not torch.distributed.is_initialized()


@pytest.mark.parametrize(("procid", "keeps_file"), [("0", True), ("1", False)])
def test_only_rank_zero_of_a_slurm_launch_keeps_the_log_file(monkeypatch, tmp_path, procid, keeps_file):
    """Rank 0 writes the run's .hydra folder and its log file, whether Hydra started from
    the command line (quiet_rank_overrides) or not (RankZeroLogFile): a run whose first
    task kept neither had no record of its config or its log."""
    import logging

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", procid)
    monkeypatch.setattr(launch.sys, "argv", ["train.py"])
    assert launch.quiet_rank_overrides() == ([] if keeps_file else list(launch.QUIET_RANK_OVERRIDES))
    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "train.log", delay=True)
    root.addHandler(handler)
    try:
        launch.RankZeroLogFile().on_job_start(None)
        assert (handler in root.handlers) == keeps_file
    finally:
        root.removeHandler(handler)


def test_quiet_ranks_leave_a_job_logging_the_command_chose_alone():
    """Its handlers may not be the default's: hydra/job_logging=disabled has no file handler
    for the quiet ranks' settings to change, and they failed its start."""
    assert launch.quiet_overrides(["seed=1"]) == list(launch.QUIET_RANK_OVERRIDES)
    assert launch.quiet_overrides(["hydra/job_logging=disabled"]) == ["hydra.output_subdir=null"]


def test_a_node_but_the_first_of_a_launch_by_hand_is_quiet(monkeypatch):
    """NODE_RANK=1 python train.py ...: it wrote a .hydra folder and a train.log of its own."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setattr(launch.sys, "argv", ["train.py"])
    assert launch.quiet_rank_overrides() == list(launch.QUIET_RANK_OVERRIDES)
    # a rank Lightning starts there (trainer.devices=2): its command has them already, and
    # Hydra refused the + setting given twice (the node's ranks died, node 0 waited)
    monkeypatch.setattr(launch.sys, "argv", ["train.py", "seed=1", *launch.QUIET_RANK_OVERRIDES])
    assert launch.quiet_rank_overrides() == []


def test_a_run_folder_in_use_by_another_run_is_refused_and_free_once_it_ends(monkeypatch, tmp_path, capsys):
    """Two runs given one hydra.run.dir at once: the second failed on the first's checkpoint
    files and mixed both runs' logs. ddp's ranks 1.. run in their rank 0's folder."""
    for name in (
        "TORCHELASTIC_RUN_ID",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
        "NODE_RANK",
        "LOCAL_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    # job_name: the script's, as Hydra names a job run from train.py
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        cfg = compose("train", [f"hydra.run.dir={tmp_path / 'run'}"], return_hydra_config=True)
    first = launch.UniqueRunFolder()
    first.on_run_start(cfg)
    with pytest.raises(SystemExit) as exit_:
        launch.UniqueRunFolder().on_run_start(cfg)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"error: hydra.run.dir={tmp_path / 'run'} is in use by another run (process {os.getpid()}): "
        "give this run a folder of its own, or wait for that run to end\n"
    )
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank Lightning's ddp started: its rank 0's folder
    rank = launch.UniqueRunFolder()
    rank.on_run_start(cfg)
    assert rank.lock is None
    monkeypatch.delenv("LOCAL_RANK")
    first.on_run_end(cfg)
    assert not (tmp_path / "run" / ".run.lock").exists()  # the folder as the run left it
    second = launch.UniqueRunFolder()
    second.on_run_start(cfg)
    assert (tmp_path / "run" / ".run.lock").read_text() == str(os.getpid())
    second.on_run_end(cfg)
    # a folder of another task's run: eval.py wrote over the training run's .hydra/ and csv
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="eval"):
        evaluation = compose("eval", [f"hydra.run.dir={tmp_path / 'run'}"], return_hydra_config=True)
    (tmp_path / "run" / ".hydra").mkdir()
    OmegaConf.save({"hydra": cfg.hydra}, tmp_path / "run" / ".hydra" / "hydra.yaml")
    with pytest.raises(SystemExit):
        launch.UniqueRunFolder().on_run_start(evaluation)
    assert capsys.readouterr().err == (
        f"error: hydra.run.dir={tmp_path / 'run'} holds a run of train.py, whose .hydra/ and results "
        "eval.py would write over: give it a folder of its own, e.g. "
        f"hydra.run.dir={tmp_path / 'run' / 'eval'}\n"
    )
    # a training sweep's folder given to eval.py -m: its jobs' .hydra/ written over
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="eval"):
        sweep = compose("eval", [f"hydra.sweep.dir={tmp_path / 'run'}"], return_hydra_config=True)
    OmegaConf.save({"hydra": cfg.hydra}, tmp_path / "run" / "multirun.yaml")
    with pytest.raises(SystemExit):
        launch.UniqueRunFolder().on_multirun_start(sweep)
    assert capsys.readouterr().err.startswith(
        f"error: hydra.sweep.dir={tmp_path / 'run'} holds a run of train.py, whose .hydra/"
    )
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="train"):
        debugged = compose(  # task_name=debug
            "train", [f"hydra.run.dir={tmp_path / 'run'}", "debug=limit"], return_hydra_config=True
        )
    started = OmegaConf.load(tmp_path / "run" / ".hydra" / "hydra.yaml")
    started.hydra.job.config_name = "mytrain"  # train.py --config-name mytrain
    OmegaConf.save(started, tmp_path / "run" / ".hydra" / "hydra.yaml")
    resumed = launch.UniqueRunFolder()  # a run of train.py, whatever its task_name or config: a resume
    resumed.on_run_start(debugged)
    resumed.on_run_end(debugged)
    # a sweep's job, in its folder, as a run in its own: a run given that folder is refused
    with open_dict(cfg), read_write(cfg):
        cfg.hydra.mode, cfg.hydra.runtime.output_dir = RunMode.MULTIRUN, str(tmp_path / "sweep" / "0")
    job = launch.UniqueRunFolder()
    job.on_job_start(cfg)
    assert (tmp_path / "sweep" / "0" / ".run.lock").read_text() == str(os.getpid())
    with pytest.raises(SystemExit):
        launch.FolderLock(tmp_path / "sweep" / "0")
    assert "sweep/0 is in use by another run" in capsys.readouterr().err
    job.on_job_end(cfg)
    assert not (tmp_path / "sweep" / "0" / ".run.lock").exists()
    # a log folder that cannot be made (Hydra failed in three chained tracebacks)
    (tmp_path / "a file").touch()
    for folder in (tmp_path / "a file" / "run", tmp_path / "a file" / "logs"):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            overrides = [f"hydra.run.dir={folder}"] if folder.name == "run" else [f"paths.log_dir={folder}"]
            cfg = compose("train", overrides, return_hydra_config=True)
        with pytest.raises(SystemExit):
            launch.UniqueRunFolder().on_run_start(cfg)
        said = capsys.readouterr().err
        assert said.startswith("error: hydra.run.dir=") and said.endswith(
            "cannot be written (Not a directory): give paths.log_dir or hydra.run.dir a writable folder\n"
        )
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):  # a sweep's: its setting named
        cfg = compose("train", [f"paths.log_dir={tmp_path / 'a file'}"], return_hydra_config=True)
    with pytest.raises(SystemExit):
        launch.UniqueRunFolder().on_multirun_start(cfg)
    assert "give paths.log_dir or hydra.sweep.dir a writable folder" in capsys.readouterr().err
    # a lock file that takes no write (a full disk: Hydra's traceback as it saved the config)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / ".run.lock").symlink_to("/dev/full")
    with pytest.raises(SystemExit):
        launch.FolderLock(tmp_path / "full")
    assert capsys.readouterr().err.startswith(f"error: hydra.run.dir={tmp_path / 'full'} cannot be written (")
    with pytest.raises(SystemExit):
        launch.refuse_unwritable(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert "(No space left on device): free space there, or give paths.log_dir" in capsys.readouterr().err


def test_runs_started_in_the_same_second_get_folders_of_their_own(monkeypatch, tmp_path):
    """They shared one, and overwrote each other's checkpoints; a folder the command names
    (a rerun in its folder, ddp's ranks 1..) is kept. Sweeps alike."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_ID", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)

    class StoppedClock:
        @staticmethod
        def now() -> datetime:
            return datetime(2026, 1, 1)

    monkeypatch.setattr(launch, "datetime", StoppedClock)

    def run_folder(*overrides: str) -> str:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", [f"paths.log_dir={tmp_path}", *overrides], return_hydra_config=True)
        folder = launch.UniqueRunFolder()
        folder.on_run_start(cfg)
        folder.on_run_end(cfg)
        return cfg.hydra.run.dir

    runs = tmp_path / "train" / "runs"
    assert run_folder() == str(runs / "2026-01-01_00-00-00")
    assert run_folder() == str(runs / "2026-01-01_00-00-00_2")
    assert run_folder() == str(runs / "2026-01-01_00-00-00_3")
    assert run_folder(f"hydra.run.dir={runs / '2026-01-01_00-00-00'}") == str(runs / "2026-01-01_00-00-00")

    # sweeps too (the second one's jobs wrote into the first one's job folders), but for a
    # folder a config names: an Optuna study's, which the same command goes on in
    def sweep_folder(*overrides: str) -> tuple[str, list[str]]:
        """The sweep's folder, and the override of it that the launcher composes each job's
        config with (it composes them again)."""
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", [f"paths.log_dir={tmp_path}", *overrides], return_hydra_config=True)
        launch.UniqueRunFolder().on_multirun_start(cfg)
        return cfg.hydra.sweep.dir, [o for o in cfg.hydra.overrides.hydra if o.startswith("hydra.sweep.dir=")]

    sweeps = tmp_path / "train" / "multiruns"
    for name in ("2026-01-01_00-00-00", "2026-01-01_00-00-00_2"):
        assert sweep_folder() == (str(sweeps / name), [f"hydra.sweep.dir='{sweeps / name}'"])
    study = tmp_path / "train" / "optuna" / "navit"
    for _ in range(2):
        assert sweep_folder("hparams_search=optuna", "hydra.sweeper.study_name=navit") == (str(study), [])
    # a SLURM task but the first: its run's folder, which the first task made
    srun_task = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    for name, value in srun_task.items():
        monkeypatch.setenv(name, value)
    (runs / "slurm-7.0").mkdir()
    assert run_folder() == str(runs / "slurm-7.0")
    # and its sweep's folder, which the first task made: a folder of its own split the sweep
    (sweeps / "slurm-7.0").mkdir()
    assert sweep_folder() == (str(sweeps / "slurm-7.0"), [])
