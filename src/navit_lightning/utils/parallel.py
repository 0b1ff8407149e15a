"""Work over many files on every core of the machine, with a progress bar."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from rich.progress import Progress

Item = TypeVar("Item")
Result = TypeVar("Result")


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
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))
    with Progress() as progress, pool:
        task = progress.add_task(description, total=len(items))
        for result in pool.map(function, items, chunksize=chunksize):
            progress.advance(task)
            yield result
