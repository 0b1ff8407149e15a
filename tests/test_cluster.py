"""Cluster launch files: the SLURM batch script and the submitit launcher config compose."""

import re
import shlex
import signal
import subprocess
import time

from hydra import compose, initialize_config_dir

from navit_lightning import CONFIG_DIR
from tests.conftest import REPO

SBATCH = REPO / "scripts" / "train.sbatch"


def test_the_sbatch_script_is_valid_bash_and_its_overrides_compose():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text()))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]  # one task per GPU
    command = SBATCH.read_text().split("srun python train.py", 1)[1].replace("\\\n", " ")
    env = {
        "$SLURM_JOB_NUM_NODES": directives["nodes"],
        "$SLURM_NTASKS_PER_NODE": directives["ntasks-per-node"],
        "$SLURM_JOB_ID": "42",
    }
    overrides = [arg for arg in shlex.split(command.splitlines()[0]) if arg not in ("$@", "&")]
    overrides = [re.sub(r"\$\w+", lambda m: env[m.group(0)], arg) for arg in overrides]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.devices == 4
    # a requeued job's folder, with one task too (run_stamp names it by job only for several)
    assert cfg.hydra.run.dir == f"{cfg.paths.log_dir}/train/runs/slurm-42"
    assert cfg.trainer.strategy._target_.endswith("HydraDDPStrategy")
    assert cfg.ckpt_path == "last"  # a requeued job resumes in its own folder


FAKE_TRAINING = """#!/bin/bash
# train.py stand-in: records its arguments, stops on SIGTERM as Lightning does (exit 1)
echo $$ > task
echo "$@" > started
if [ -n "${FAKE_EXIT:-}" ]; then exit "$FAKE_EXIT"; fi
trap 'echo stopped > stopped; exit 1' TERM
for _ in $(seq 600); do sleep 0.1; done
"""


def run_sbatch(tmp_path, signal_at_s: float | None = None, exit_code: int | None = None) -> int:
    """The batch script with stand-ins for python (running until SIGTERM, or ending at once
    with exit_code), srun, scancel (signals the job's task, as SLURM's does) and scontrol;
    USR1 (SLURM's warning before the time limit) sent after signal_at_s seconds, if given."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:{REPO / "tests" / "bin"}:$PATH"\n')
    for name, text in [
        ("python", FAKE_TRAINING),
        ("scontrol", '#!/bin/sh\necho "$@" > "$(dirname "$0")/../../scontrol"\n'),
        ("scancel", '#!/bin/sh\necho "$@" > scancel\nkill -TERM "$(cat task)"\n'),
    ]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "FAKE_EXIT": "" if exit_code is None else str(exit_code),
    }
    script = subprocess.Popen(["bash", str(SBATCH), "seed=3"], cwd=tmp_path, env=env)
    for _ in range(100):
        if (tmp_path / "started").exists():
            break
        time.sleep(0.05)
    if signal_at_s is not None:
        time.sleep(signal_at_s)
        script.send_signal(signal.SIGUSR1)
    return script.wait(timeout=120)


def test_the_sbatch_script_requeues_its_job_when_the_time_limit_nears(tmp_path):
    assert run_sbatch(tmp_path, signal_at_s=0.5) == 0
    started = (tmp_path / "started").read_text()
    assert "ckpt_path=last hydra.run.dir=${paths.log_dir}/${task_name}/runs/slurm-42 seed=3" in started
    # the tasks got SIGTERM from SLURM: srun, given it, would have SIGKILLed them unsaved
    assert (tmp_path / "scancel").read_text().split() == ["--signal=TERM", "42"]
    assert (tmp_path / "stopped").exists()
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "42"]


def test_the_sbatch_script_passes_on_an_exit_code_and_requeues_only_on_time(tmp_path):
    (tmp_path / "a").mkdir()
    assert run_sbatch(tmp_path / "a", exit_code=0) == 0
    (tmp_path / "b").mkdir()
    assert run_sbatch(tmp_path / "b", exit_code=5) == 5
    assert not (tmp_path / "a" / "scontrol").exists() and not (tmp_path / "b" / "scontrol").exists()


def test_the_slurm_launcher_sizes_jobs_from_the_trainer_config():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "strategy=ddp", "trainer.devices=4", "trainer.num_nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
