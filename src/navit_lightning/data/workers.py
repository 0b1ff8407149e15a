"""Processes that work for the data code: loader workers and pools over many files."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext
from typing import TypeVar

from rich.progress import Progress

Item = TypeVar("Item")
Result = TypeVar("Result")

# Imported once by the forkserver, before its first fork: without it every process started
# from it imports torch and the data code itself (~2 s each). One list for every user of the
# server, which is started once per process: whoever starts it first decides what it holds.
FORKSERVER_PRELOAD = ["navit_lightning.data.folder", "navit_lightning.data.packing"]


def start_context(method: str | None) -> BaseContext:
    """The multiprocessing context of `method` (None: the platform's default)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


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
    # the data config's multiprocessing_context)
    pool = ProcessPoolExecutor(workers, mp_context=start_context("forkserver"))
    with Progress() as progress, pool:
        task = progress.add_task(description, total=len(items))
        for result in pool.map(function, items, chunksize=chunksize):
            progress.advance(task)
            yield result
