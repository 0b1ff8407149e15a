"""Where a training step's milliseconds go: torch's profiler over a few steps, each op's own
time summed into the parts of a ViT step (matmuls, attention, norms, GELU, layout copies,
gathers, other elementwise work, the optimizer, a compiled step's fused kernels) plus what no
op accounts for (Python, the autograd engine and dispatch on a CPU; an idle GPU on CUDA). And
a step's peak host memory, which torch's CPU allocator does not keep, from the profiler's
record of every allocation.

The attention benchmark calls them (`--profile`, `--memory`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

# Each part and what its ops' names (aten::...) contain; the first match wins ("scatter"
# holds "cat": the gathers come before the copies).
PARTS: dict[str, tuple[str, ...]] = {
    "matmuls": ("mm", "linear", "matmul"),
    "attention (SDPA, flash, flex, varlen)": ("attention", "flex", "varlen"),
    "LayerNorm": ("layer_norm",),
    "GELU": ("gelu",),
    "gathers, scatters (layout, positions, pooling)": ("index", "scatter", "gather", "embedding"),
    "copies, cat, stack (layout)": ("copy", "cat", "stack", "clone", "contiguous"),
}
OPTIMIZER = "optimizer (AdamW step, zero_grad)"
# inductor runs its fused kernels outside aten ops: on a CPU inside the compiled graph's call,
# on CUDA each triton launch under its kernel's name. Its matmuls stay aten ops (extern kernels).
COMPILED = "compiled kernels (inductor's fused ops, flex attention's)"
COMPILED_NAMES = ("## Call CompiledFxGraph", "triton")
OTHER = "other elementwise and reductions"
UNACCOUNTED = {"cpu": "Python, autograd engine, dispatch (no op)", "cuda": "GPU idle (no kernel)"}


@dataclass
class StepProfile:
    step_ms: float  # wall time of a step, profiled
    parts: dict[str, float]  # ms per step of each part, UNACCOUNTED included


def profile_table(profiles: dict[str, StepProfile]) -> str:
    """One markdown table: a row per part (largest first in the first profile), a column pair
    (ms per step, share of the step) per named profile."""
    first = next(iter(profiles.values()))
    parts = sorted(
        {part for p in profiles.values() for part in p.parts}, key=lambda part: -first.parts.get(part, 0)
    )
    head = "| part of the step | " + " | ".join(f"{name} ms | share" for name in profiles) + " |"
    rows = [
        f"| {part} | "
        + " | ".join(
            f"{p.parts.get(part, 0):.1f} | {p.parts.get(part, 0) / p.step_ms:.0%}" for p in profiles.values()
        )
        + " |"
        for part in parts
    ]
    rows.append("| whole step | " + " | ".join(f"{p.step_ms:.1f} | 100%" for p in profiles.values()) + " |")
    return "\n".join([head, "|---|" + "---|---|" * len(profiles), *rows])


def part_of(event: FunctionEvent) -> str:
    """The part an op's own time belongs to: the optimizer's ops by their caller, the rest by name."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("Optimizer.step", "Optimizer.zero_grad")):
            return OPTIMIZER
        parent = parent.cpu_parent
    if event.name.startswith(COMPILED_NAMES):  # before PARTS: a graph's hash may hold "mm"
        return COMPILED
    name = event.name.removeprefix("aten::")
    return next((part for part, names in PARTS.items() if any(n in name for n in names)), OTHER)


def profile_step(step: Callable[[], None], device: torch.device, steps: int = 3) -> StepProfile:
    """`steps` calls of `step` (already warmed up) under the profiler."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = 1000 * (time.perf_counter() - start) / steps
    parts: dict[str, float] = {}
    for event in prof.events():
        # A user annotation's own time (Optimizer.step#...) is the optimizer's Python. A CUDA
        # kernel is also an event of its own, besides the CPU op that launched it: count it once.
        if event.device_type != DeviceType.CPU or not event.name.startswith(
            ("aten::", "Optimizer.", *COMPILED_NAMES)
        ):
            continue
        own_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        part = OPTIMIZER if event.name.startswith("Optimizer.") else part_of(event)
        parts[part] = parts.get(part, 0.0) + own_us / 1000 / steps
    parts[UNACCOUNTED[device.type]] = max(0.0, wall_ms - sum(parts.values()))
    return StepProfile(wall_ms, parts)


def peak_host_bytes(step: Callable[[], object]) -> int:
    """The most bytes of CPU tensors that one call of `step` held at once beyond what was
    held before it: the running sum of every op's own allocations and frees, in the order
    the ops started."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    changes = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    held = peak = 0
    for event in changes:
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
