"""How long one epoch's plan takes on every rank, and how much memory it holds, for large
synthetic data sets.

    python -m navit_lightning.bench.planning [--images 1000000 10000000] [--ranks 8]

Every rank plans the whole epoch (sizes and token drops, order, first-fit-decreasing packing
over the look-ahead) identically before dealing the batches out, so this is the cost each
rank pays per epoch. The data.* defaults apply (patch 16, as navit_small's and navit_base's;
patch budgets 12..36, batches of 14 rows x 144 tokens with at most 32 images a row, look-ahead
512); the image sizes are synthetic and seeded: mostly camera photos (4:3, 3:2, 16:9, 1:1
either way up, long side 320..4032 px), a third of any aspect from 1:4 to 4:1 and area.

Each data set size is measured in a fresh process; per phase it prints seconds, and for the
whole plan the peak resident memory above what the process held before planning (Linux
VmHWM, reset through /proc/self/clear_refs, after malloc_trim) and what the finished plan
keeps resident.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from navit_lightning.batch import PackedShape
from navit_lightning.bench import at_least_one
from navit_lightning.data.sampler import PackedBatchSampler, SizePolicy, _EpochPlan, plan_batches

SHAPE = PackedShape(rows=14, row_len=144, max_images=32)
POLICY = SizePolicy(patch_size=16, max_patches=36, min_patches=12)
LOOKAHEAD = 512
SEED = 0
PHASES = ("init", "keys", "order", "packing", "deal", "stats", "digest")


def synthetic_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """`count` seeded (height, width) pairs, as a folder's dataset lists them."""
    rng = np.random.default_rng(seed)
    photo = rng.random(count) < 2 / 3
    # photos: a camera aspect, landscape or portrait, long side log-uniform
    aspect = rng.choice([4 / 3, 3 / 2, 16 / 9, 1.0], size=count)
    aspect = np.where(rng.random(count) < 0.3, 1 / aspect, aspect)  # width / height
    long_side = np.exp(rng.uniform(np.log(320), np.log(4032), count))
    photo_w = np.where(aspect >= 1, long_side, long_side * aspect)
    photo_h = photo_w / aspect
    # the rest: any aspect in 1:4..4:1, any area from 64^2 to 2000^2 px
    any_aspect = np.exp(rng.uniform(np.log(1 / 4), np.log(4), count))
    area = np.exp(rng.uniform(np.log(64**2), np.log(2000**2), count))
    height = np.where(photo, photo_h, np.sqrt(area / any_aspect))
    width = np.where(photo, photo_w, np.sqrt(area * any_aspect))
    sides = np.maximum(1, np.rint(np.stack([height, width], 1))).astype(np.int64)
    return list(map(tuple, sides.tolist()))


def _memory_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _timed(seconds: dict[str, float], phase: str, work: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = work()
    seconds[phase] = time.perf_counter() - start
    return result


def measure(count: int, ranks: int) -> dict[str, float]:
    """One epoch's plan for rank 0 of `ranks` over `count` synthetic images: seconds per
    phase, and MiB of peak and held memory above the process's before planning."""
    sizes = synthetic_sizes(count, SEED)
    # Memory the allocator freed but kept resident would be reused unseen: give it back.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _memory_kib("VmRSS")
    figures: dict[str, float] = {}
    sampler = _timed(
        figures,
        "init",
        lambda: PackedBatchSampler(
            sizes, SHAPE, POLICY, shuffle=True, seed=SEED, lookahead=LOOKAHEAD, num_replicas=ranks
        ),
    )
    epoch = sampler.sampler.epoch
    keys = _timed(figures, "keys", lambda: POLICY.keys(sampler.sizes, SEED, epoch))
    order = _timed(figures, "order", sampler.sampler.indices)
    sampler._plan = _timed(
        figures, "packing", lambda: _EpochPlan(epoch, keys, plan_batches(keys.keep, order, SHAPE, LOOKAHEAD))
    )
    _timed(figures, "deal", lambda: list(sampler))  # this rank's batches, as the loader takes them
    stats = _timed(figures, "stats", sampler.plan_stats)
    _timed(figures, "digest", lambda: sampler._plan.digest)
    figures["total"] = sum(figures[phase] for phase in PHASES)
    figures["peak_mib"] = (_memory_kib("VmHWM") - before) / 1024
    figures["held_mib"] = (_memory_kib("VmRSS") - before) / 1024
    figures["batches"] = len(sampler._plan.batches)  # the epoch's, before filler batches even out the ranks
    figures["fill"] = stats.fill
    return figures


def _in_fresh_process(count: int, ranks: int) -> dict[str, float]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (count, ranks))


def table(rows: dict[int, dict[str, float]]) -> str:
    head = [
        "images",
        *(f"{phase} s" for phase in PHASES),
        "total s",
        "peak MiB",
        "held MiB",
        "batches",
        "fill",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for count, f in rows.items():
        cells = [f"{count:,}", *(f"{f[phase]:.2f}" for phase in PHASES), f"{f['total']:.2f}"]
        cells += [
            f"{f['peak_mib']:,.0f}",
            f"{f['held_mib']:,.0f}",
            f"{f['batches']:,.0f}",
            f"{f['fill']:.1%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=at_least_one, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--ranks", type=at_least_one, default=8)
    args = parser.parse_args()
    rows = {}
    for count in args.images:
        rows[count] = _in_fresh_process(count, args.ranks)
        print(f"{count:,} images planned", flush=True)
    print(f"One epoch's plan per rank ({args.ranks} ranks; rank 0's deal and stats):")
    print(table(rows))


if __name__ == "__main__":
    main()
