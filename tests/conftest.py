"""Shared fixtures: a small generated shapes set and a runner for the entry points."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hydra.core.hydra_config import HydraConfig

from navit_lightning.data import shapes
from navit_lightning.utils.shutdown import descendants
from tests.zygote import RunServer

REPO = Path(__file__).resolve().parents[1]
TINY_SPEC = shapes.ShapesSpec(num_train=192, num_val=48, num_test=48, max_side=160)
# where a run given TINY_SHAPES reads it, in its PROJECT_ROOT
TINY_SET = Path("data") / shapes.folder_name(asdict(TINY_SPEC))
# Overrides that point a run at the tiny shapes set,
TINY_SHAPES = [
    f"data.generate.num_train={TINY_SPEC.num_train}",
    f"data.generate.num_val={TINY_SPEC.num_val}",
    f"data.generate.num_test={TINY_SPEC.num_test}",
    f"data.generate.max_side={TINY_SPEC.max_side}",
]
# and that keep a run short, whatever its data: they shrink it, never switch off callbacks,
# loggers or the strategy (a rank-0-only callback once hung every multi-process run while
# runs without it passed).
TINY_TRAINING = [
    "data.rows=4",
    "data.num_workers=0",
    "model.net.dim=32",
    "model.net.depth=1",
    "model.net.heads=2",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
]
TINY_RUN = TINY_SHAPES + TINY_TRAINING
# Runs forked from a server that has imported their libraries (tests/zygote.py): 0 for new processes.
FORKED_RUNS = os.environ.get("NAVIT_TESTS_FORKED_RUNS", "1") != "0"
# Two ddp ranks on the CPU, as the README runs them on a laptop.
DDP_TWO_RANKS = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]


def bare_trainer(**settings: Any) -> L.Trainer:
    """A Trainer on the CPU with `settings` and nothing else: no logger, checkpoint, progress
    bar or summary."""
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **settings,
    )


def run_whole(command: str | list[str], *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout), but a
    timeout or an interrupted test kills every process the command started (ddp's other
    ranks, torchrun's workers, loader workers), where subprocess.run kills the first alone
    and leaves the rest of a hung run behind."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            for pid in [process.pid, *descendants(process.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_folder(root: Path, task: str = "train") -> Path:
    """The one run folder that `task` (train, eval, predict) left in root's logs."""
    (run,) = (root / "logs" / task / "runs").iterdir()
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_two_gloo_ranks(rank_does: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """What `rank_does(rank, *args)` returns on each rank of a 2-rank gloo group of forked
    processes (torch is imported already: ~1 s a process, not ~10), or its exception's repr."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_gloo_rank, args=(rank, port, results, rank_does, args)) for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        return dict(results.get(timeout=60) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=10)
            process.kill()


def _gloo_rank(rank: int, port: int, results: Any, rank_does: Callable[..., Any], args: tuple) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank
    )
    try:
        results.put((rank, rank_does(rank, *args)))
    except Exception as error:
        results.put((rank, repr(error)))
    finally:
        torch.distributed.destroy_process_group()


class GlooStrategy:
    """Lightning's ddp strategy's broadcast and reduce_boolean_decision, on on_two_gloo_ranks' group."""

    def broadcast(self, value: Any) -> Any:
        values = [value]
        torch.distributed.broadcast_object_list(values, src=0)
        return values[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = torch.tensor(int(decision))
        torch.distributed.all_reduce(votes)
        return bool(votes == torch.distributed.get_world_size()) if all else bool(votes)


def logged_scalars(events: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard event file, or in all of a folder's: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture(autouse=True)
def hydra_config_cleared() -> Iterator[None]:
    """A test that sets Hydra's global config as a run's (test_configs.compose_train) leaves
    it to no other: a sweep's (hparams_search=optuna) made later checks in that process take
    themselves for a sweep's job."""
    yield
    HydraConfig.instance().cfg = None


@pytest.fixture(scope="session")
def project_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PROJECT_ROOT for subprocess runs, its data/ holding the tiny shapes set."""
    root = tmp_path_factory.mktemp("project")
    shapes.generate(root / TINY_SET, TINY_SPEC)
    return root


@pytest.fixture(scope="session")
def run_server() -> Iterator[RunServer]:
    server = RunServer()
    yield server
    server.close()


@pytest.fixture
def run_entry_point(project_root: Path, tmp_path: Path, run_server: RunServer):
    """entry_point_runner for a fresh PROJECT_ROOT holding the tiny shapes set."""
    (tmp_path / "data").symlink_to(project_root / "data")
    return entry_point_runner(tmp_path, run_server)


def entry_point_runner(root: Path, server: RunServer):
    """A function that runs train.py, eval.py or predict.py with logs under PROJECT_ROOT
    `root`, from there unless `cwd` is given: forked from `server` (tests/zygote.py) unless a
    `launcher` or `fresh_process` asks for a new process, or NAVIT_TESTS_FORKED_RUNS=0 for
    every run."""

    def run(
        script: str,
        *overrides: str,
        check: bool = True,
        launcher: tuple[str, ...] = (sys.executable,),
        fresh_process: bool = False,
        timeout: float = 300,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        env = {**os.environ, "PROJECT_ROOT": str(root), "HYDRA_FULL_ERROR": "1", **(env or {})}
        command = [*launcher, str(REPO / script), *overrides]
        forked = launcher == (sys.executable,) and not fresh_process and FORKED_RUNS
        start = server.run if forked else run_whole
        result = start(command, cwd=cwd or root, env=env, timeout=timeout)
        assert result.returncode == 0 or not check, (
            f"{script} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
        return result

    run.root = root
    return run
