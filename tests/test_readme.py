"""Every command line in the README's code blocks runs here as a user types it, with only
what shrinks it appended (the tiny shapes data, one epoch, fewer timed steps) and its
placeholders filled in (a run folder, an image folder, this host). Commands that need a GPU
are refused on CPU with their one-line error and exit code 2, and run for real where CUDA
is. A README command that no rule below knows fails the suite."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
    TINY_RUN,
    TINY_SET,
    TINY_SHAPES,
    entry_point_runner,
    free_port,
    run_folder,
    run_whole,
)
from tests.test_entry_points import assert_sane_rates, assert_written_once_by_rank_zero
from tests.zygote import RunServer

pytestmark = pytest.mark.slow

PROGRAMS = ("python", "torchrun", "make", "sbatch", "pip", ".venv/bin/")
# Shrink a training run by its data and its length only: the model, callbacks, loggers and
# strategy stay as the README has them.
SHRINK_TRAINING = [*TINY_SHAPES, "trainer.max_epochs=1"]
# Refused on a machine without CUDA (utils/validate.py), run where it has one.
NEEDS_CUDA = ("strategy=dp", "model.net.attention=flex", "trainer.sync_batchnorm=true")


def readme_commands(text: str) -> list[str]:
    """The command lines of the README's indented code blocks: continuation lines joined,
    comments dropped, only lines that start a program (after VAR=value assignments), each
    once (the README repeats some where they are used)."""
    commands, pending = [], ""
    for line in text.splitlines():
        if not line.startswith("    ") or not line.strip():
            pending = ""
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = re.sub(r"\s+#.*$", "", line)
        program = next((w for w in line.split() if "=" not in w), "")
        if program.startswith(PROGRAMS):
            commands.append(line)
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands((REPO / "README.md").read_text())


def as_run_here(command: str, run: str, images: Path) -> tuple[str, Path | None]:
    """The command as it runs on this machine, and the folder to run it in (None: the
    project root). Raises LookupError for a command no rule knows."""
    filled = (
        command.replace("<run>", run)
        .replace("ckpt_path=...", f"ckpt_path=logs/train/runs/{run}/checkpoints/last.ckpt")
        .replace("/path/to/images", str(images))
        .replace("/path/to/shards", str(images.parent / "readme-shards"))
    )
    # an image folder of its own is already small: only the epochs shrink
    shrink = (
        "trainer.max_epochs=1"
        if re.search(r"data=(imagefolder|shards)", filled)
        else shlex.join(SHRINK_TRAINING)
    )
    if "data=shards" in filled:  # written by the README's command before it, written here again
        shards = re.search(r"data\.root=(\S+)", filled).group(1)
        filled = f"python -m navit_lightning.data.shards {images} {shards} && {filled}"
    if re.match(r"(\S+=\S+ )*python (train|eval|predict)\.py", filled):
        if "ckpt_path=" in filled and "train.py" in filled:  # a resumed run trains one epoch more
            return f"{filled} {shlex.join(TINY_SHAPES)} trainer.max_epochs=2", None
        if "hydra/launcher=slurm" in filled:  # no SLURM here: its first job composes with the
            # launcher (--cfg excludes -m, and a sweep's values need -m)
            first = re.sub(r"=(\w+),\S+", r"=\1", filled.replace(" -m ", " "))
            return f"{first} {shrink} --cfg hydra | grep -q 'hydra_plugins.hydra_submitit_launcher'", None
        if filled.startswith("MASTER_ADDR="):  # one node of N by hand: this host, N = 1
            filled = re.sub(r"MASTER_ADDR=\S+ MASTER_PORT=\S+ NODE_RANK=\S+", "", filled)
            filled = f"MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()} NODE_RANK=0 " + filled.strip()
            filled = filled.replace("trainer.num_nodes=N", "trainer.num_nodes=1")
        if "hparams_search=" in filled:  # fewer trials, and a study of its own to run them in
            study = f"readme{abs(hash(filled)) % 10**6}"
            shrink += f" hydra.sweeper.n_trials=2 hydra.sweeper.study_name={study}"
        return f"{filled} {shrink if 'train.py' in filled else ''}", None
    if filled.startswith("torchrun"):  # the multi-node recipe on one node: this host
        for written, here in [
            ("--nnodes=2", "--nnodes=1"),
            ("trainer.num_nodes=2", "trainer.num_nodes=1"),
            ("HOST:29500", f"127.0.0.1:{free_port()}"),
        ]:
            filled = filled.replace(written, here)
        arguments = filled.split(maxsplit=1)[1].replace(" train.py ", f" {REPO}/train.py ")
        return f"{sys.executable} -m torch.distributed.run {arguments} {shrink}", None
    if re.match(r"python -m navit_lightning\.data\.(index|shards) ", filled):
        return filled, None
    shrunk_bench = {
        "index": "--images 300 --formats 1000",
        "planning": "--images 20000 --ranks 2",
        "decoders": "--count 6 --rounds 1 --budgets 36",
    }
    bench = re.match(r"python -m navit_lightning\.bench\.(index|planning|decoders)", filled)
    if bench:
        return f"{bench.group(0)} {shrunk_bench[bench.group(1)]}", None
    if filled.startswith("python -m navit_lightning.bench.attention"):
        flags = re.sub(r"[\[\]]", "", filled)
        # one block: its bf16 cases, dense sdpa at 2048-token rows above all, are slow on an
        # AVX2 host (47 s serially with navit_tiny's four blocks, 18 s with one)
        shrunk = (
            "--models navit_tiny --set model.net.depth=1 --tokens 512 --row-len 256 --steps 1 --no-compile"
        )
        return f"{flags} {shrunk} --backends sdpa segments", None
    if re.match(r"python -m navit_lightning\.bench\.(data_loading|step)", filled):
        # the tests' tiny model too: bench.step on navit_tiny takes 28 s serially, 10 s with it
        filled = filled.replace("[train.py overrides]", shlex.join(TINY_RUN))
        steps = " --steps 2 --warmup 1" if ".bench.step" in filled else ""
        # optional flags left out: test_bench runs --ablate
        return re.sub(r"\s*\[--[^\]]*\]", "", filled) + steps, None
    if filled.startswith("sbatch scripts/train.sbatch"):  # no SLURM: one task, srun a pass-through
        overrides = " ".join(filled.split(maxsplit=2)[2:])
        return f"SLURM_JOB_ID=42 bash scripts/train.sbatch {overrides} {shrink}", REPO
    if filled == 'pip install -e ".[cluster]"':  # installed by make's dev extra: the plugin imports
        return f"{sys.executable} -c 'import hydra_plugins.hydra_submitit_launcher.submitit_launcher'", None
    if filled == "make train":
        return f"make train ARGS={shlex.quote(shrink)}", REPO
    if filled == "make test":  # one quick test file in one process: the suite is what runs this
        return "make test TEST_WORKERS=0 ARGS=tests/test_packing.py", REPO
    if filled.startswith(".venv/bin/python -m pytest"):
        return f"{filled} tests/test_packing.py", REPO
    if filled == "make lint":
        return filled, REPO
    if filled == "make clean":  # the runs stay: it removed logs/ with every checkpoint
        return (
            "mkdir -p logs/train .pytest_cache && make clean "
            "&& test -d logs/train && ! test -e .pytest_cache",
            "clone",
        )
    if filled == ".venv/bin/pre-commit install":  # into a clone: the checkout's hooks stay as they are
        return filled, "clone"
    if filled == ".venv/bin/tensorboard --logdir logs/":  # a server: read the logs once and exit
        return f"{REPO}/{filled} --inspect", None
    raise LookupError(f"no rule runs this README command: {command}")


@pytest.fixture(scope="module")
def readme_root(
    project_root: Path, tmp_path_factory: pytest.TempPathFactory, run_server: RunServer
) -> tuple[Path, str]:
    """A project root with the tiny data and one finished run (the README's <run>), forked
    (tests/zygote.py): the README's own commands run as new processes."""
    root = tmp_path_factory.mktemp("readme")
    (root / "data").symlink_to(project_root / "data")
    entry_point_runner(root, run_server)("train.py", *SHRINK_TRAINING, timeout=540)
    run = run_folder(root).name
    return root, run


def shell(command: str, cwd: Path, root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(root), "HYDRA_FULL_ERROR": "1"}
    # `python` is this interpreter; tests/bin holds an `srun` that runs one task in place
    paths = [str(Path(sys.executable).parent), str(REPO / "tests" / "bin"), env["PATH"]]
    env["PATH"] = os.pathsep.join(paths)
    env["SLURM_JOB_NUM_NODES"], env["SLURM_NTASKS_PER_NODE"] = "1", "1"  # for the sbatch script
    return run_whole(
        re.sub(r"python (train|eval|predict)\.py", rf"python {REPO}/\1.py", command),
        shell=True,
        cwd=cwd,
        env=env,
        timeout=540,
    )


def test_the_readme_has_commands_and_every_one_has_a_rule():
    assert len(COMMANDS) >= 20, COMMANDS
    for command in COMMANDS:
        as_run_here(command, "RUN", Path("/images"))


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, readme_root, tmp_path):
    root, run = readme_root
    line, cwd = as_run_here(command, run, root / TINY_SET / "val")
    if cwd == "clone":
        subprocess.run(["git", "clone", "-q", str(REPO), str(tmp_path / "clone")], check=True)
        (tmp_path / "clone" / ".venv").symlink_to(REPO / ".venv")
        cwd = tmp_path / "clone"
    jobs_before = set(root.glob("logs/train/*/*/*/.hydra"))  # a sweep's jobs, seeds' or Optuna's
    result = shell(line, cwd or root, root)
    output = result.stdout + result.stderr
    refused = any(setting in command.split() for setting in NEEDS_CUDA) and not torch.cuda.is_available()
    if refused:
        assert result.returncode == 2, output[-3000:]
        assert re.search(r"error: .*(GPU|CUDA|on CPU)", output), output[-3000:]
    else:
        assert result.returncode == 0, f"{line}\n{output[-4000:]}"
    words = command.split()
    two_ranks = "trainer.devices=2" in words and {"strategy=ddp", "strategy=ddp_spawn"} & set(words)
    if two_ranks and "-m" not in words:  # the suite's only 2-rank run of the
        # default callbacks with ddp and ddp_spawn: every rank enters every collective in the
        # same order, a whole epoch with validation and the test; spawned ranks log as rank 0's
        # job, once
        run = max((root / "logs" / "train" / "runs").iterdir())
        assert_written_once_by_rank_zero(run)
        assert_sane_rates(output)
        assert "world size 2" in output and re.search(r"test/acc\s+│\s+[0-9.]+", output), output[-3000:]
        # nothing to act on: Lightning's advice to sync an epoch's log, torch's deprecations
        assert "sync_dist=True" not in output and "is deprecated" not in output, output[-3000:]
    if "strategy=ddp_spawn" in words:
        # its ranks start for fit, for test, and for one evaluation across all patch budgets
        assert output.count("Initializing distributed: GLOBAL_RANK: 0,") == 3, output[-3000:]
        # Rank 1 evaluates filler batches only on the tiny data: its metrics take them, where
        # torchmetrics' accuracy refused them and warned of a compute before any update.
        assert "before the ``update``" not in output, output[-3000:]
    if re.search(r"train\.py -m .*strategy=ddp\b", line):  # Lightning's ddp launcher would start
        # the whole sweep again in each rank it starts (its issue 11300): one sweep folder, each
        # job run once in its own
        jobs = sorted(job.parent for job in set(root.glob("logs/train/*/*/*/.hydra")) - jobs_before)
        assert [job.name for job in jobs] == ["0", "1"] and jobs[0].parent == jobs[1].parent, jobs
        for job in jobs:
            assert_written_once_by_rank_zero(job)
