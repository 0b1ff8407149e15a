"""Processes that work for the data code: loader workers and pools over many files."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import suppress
from multiprocessing import resource_tracker
from multiprocessing.context import BaseContext
from typing import TypeVar

from rich.progress import Progress

Item = TypeVar("Item")
Result = TypeVar("Result")

# The code a loader worker runs, imported once by the forkserver before its first fork so that
# no worker imports it again (~1 s each). Lightning stays out of it: it would add ~2.5 s to
# the start of the server, which every process of a run waits for before its first batch.
WORKER_MODULES = [
    "navit_lightning.data.forkserver_signals",
    "navit_lightning.data.folder",
    "navit_lightning.data.packing",
    "navit_lightning.data.workers",
]


# What a scheduler sends every process of a job: SIGTERM to stop it (scancel, a preemption,
# systemd, `timeout`), SIGUSR1 or SIGUSR2 to have it save and be requeued (SLURM's
# --signal=USR1@90, Lightning's recipe; submitit's USR2). The training processes handle them
# (utils/shutdown.py); a loader process that died of one failed the rank's next batch, and a
# ddp run ended on that error without saving, where its training processes stop together
# before a step and save last.ckpt.
JOB_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def ignore_job_signals() -> None:
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def usable_cores() -> int:
    """The CPU cores this process may run on (a SLURM task's --cpus-per-task, taskset, a
    container's cpuset), where os.cpu_count() counts the node's: 128 workers started in a
    job of 8 cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def forkserver_preload() -> list[str]:
    """What the forkserver imports before its first fork: WORKER_MODULES and what the main
    module needs. multiprocessing runs the main module again in every process started from
    the server. A script (train.py) the server runs once itself ('__main__'), and the
    processes skip it. `python -m X` each process runs again; preloaded by name, X would be
    run over itself, with a RuntimeWarning from runpy at every worker's start. So the server
    holds the data module X imported to build its loaders, and with it Lightning: the part
    of X's imports that costs (2.7 s to a first batch, against 4.7 s without). One list for
    every user of the server, started once per process: whoever starts it first decides."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # a shell's may be no module
    # a package's __main__ (python -m pytest) multiprocessing never runs again
    module_main = spec is not None and not spec.name.endswith("__main__")
    return ["__main__", *WORKER_MODULES, *(["navit_lightning.data.datamodule"] if module_main else [])]


def start_context(method: str | None) -> BaseContext:
    """The multiprocessing context of `method` (None: the platform's default), its resource
    tracker deaf to JOB_SIGNALS: it ignores SIGINT and SIGTERM alone, died of SIGUSR1 sent
    to every process of the job, and each shared-memory block the loaders freed then printed
    a KeyError traceback. It keeps the signals blocked that it started with."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(forkserver_preload())
    return context


def loader_context(method: str | None) -> BaseContext:
    """start_context for loader workers, which ignore SIGTERM (loader_worker_init): this
    process kills them at its exit, where multiprocessing would end them with SIGTERM and wait
    for them forever."""
    _kill_daemonic_children_at_exit(os.getpid())
    return start_context(method)


@functools.cache  # once a process; `pid`, so that a forked child registers its own
def _kill_daemonic_children_at_exit(pid: int) -> None:
    # multiprocessing's exit function (atexit's, or the end of a process multiprocessing
    # started, which runs no atexit) runs the finalizers of priority >= 0 before it ends and
    # waits for the daemonic children
    multiprocessing.util.Finalize(None, _kill_daemonic_children, exitpriority=0)


def _kill_daemonic_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def loader_worker_init(pid: int, worker_id: int) -> None:
    """A DataLoader `worker_init_fn` (bind `pid`, the training process, with functools.partial).
    The worker ignores JOB_SIGNALS and SIGINT, and ends with the training process. Ctrl-C, and
    a notebook's interrupt, go to every process of the group: the training process stops as it
    does on SIGINT, and a worker ended by it broke its persistent loader, a datamodule's, for
    every pass after ("DataLoader worker exited unexpectedly")."""
    ignore_job_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_process(pid)


def pool_worker_init(pid: int) -> None:
    """A pool's initializer: SIGTERM ends the worker (the server it is forked from ignores
    it), so that a stop while the built-in set is generated ends the pool at once; and it
    ends with the process `pid` that maps over the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    exit_with_process(pid)


def exit_with_process(pid: int) -> None:
    """The calling worker ends when the process `pid` does. torch's workers watch their
    parent, which under the forkserver start method is the server; the server ends only when
    its children have, so a training process killed with SIGKILL would leave both behind for
    good (it did, holding the run's output pipes open)."""
    threading.Thread(target=_exit_after, args=(pid,), name="exit-with-training-process", daemon=True).start()


def _exit_after(pid: int) -> None:
    if hasattr(os, "pidfd_open"):  # Linux: woken when the process ends
        with suppress(ProcessLookupError):
            select.select([os.pidfd_open(pid)], [], [])
    else:
        with suppress(ProcessLookupError):
            while True:
                os.kill(pid, 0)
                time.sleep(1.0)
    os._exit(0)


def map_with_progress(
    function: Callable[[Item], Result],
    items: Sequence[Item],
    description: str,
    workers: int,
    chunksize: int = 256,
) -> Iterator[Result]:
    """function(item) for every item, in order, over `workers` processes (a module-level
    function: it is pickled), with a progress bar."""
    # forkserver: the progress bar's thread is running when the pool starts a process (see
    # the data config's multiprocessing_context). Its workers end with this process, as a
    # loader's do: killed with SIGKILL while generating, it left them behind for good.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=start_context("forkserver"),
        initializer=pool_worker_init,
        initargs=(os.getpid(),),
    )
    with Progress() as progress, pool:
        task = progress.add_task(description, total=len(items))
        for result in pool.map(function, items, chunksize=chunksize):
            progress.advance(task)
            yield result
