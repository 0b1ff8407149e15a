"""Cluster launch files: the SLURM batch script and the submitit launcher config compose."""

import re
import shlex
import subprocess

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
    }
    overrides = [arg for arg in shlex.split(command.splitlines()[0]) if arg != "$@"]
    overrides = [re.sub(r"\$\w+", lambda m: env[m.group(0)], arg) for arg in overrides]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.devices == 4
    assert cfg.trainer.strategy._target_.endswith("HydraDDPStrategy")


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
