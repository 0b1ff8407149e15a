"""Does packing pay? Train-step speed of each attention backend, against a padded ViT batch
of the same images, as rows grow, against other NaViT implementations, and as a share of
the machine's matmul rate.

    python -m navit_lightning.bench.attention [--models navit_tiny navit_small]
        [--set model.net.depth=6 ...] [--backends sdpa segments flex varlen]
        [--peers vit-pytorch timm] [--tokens 4096] [--sides 4 16] [--row-len 512] [--steps 5]
        [--no-compile] [--bf16] [--grad-checkpointing] [--memory] [--largest BACKEND]
        [--profile] [--release-host-memory] [--json FILE] [--markdown FILE]

One fixed, seeded workload of mixed-resolution images (`--sides` patches a side, aspect up
to 2:1) is packed into `--tokens` tokens per step; every figure comes from this one run:
  1. packed: real patches/s and images/s of a forward + backward + AdamW step, per backend,
     with and without torch.compile;
  2. padded: the same images resized to one square size (the nearest to the same total
     patch count), one image per row (what a fixed-resolution ViT would be fed), same network, with and
     without torch.compile;
  3. scaling: step time as the row length grows (256 .. 2048, from the first that holds the
     longest image) at the same image mix;
  4. peers: vit-pytorch's NaViT at each of those row lengths (its group_max_seq_len) and timm's
     NaFlexViT, at equal architecture on the same images (bench/peers.py), where installed;
  5. the machine's matmul rate, probed here, and each step's achieved model-FLOP rate
     (NaViT.train_flops: attention within images only) as a share of it, and of the
     device's nominal bf16 peak where known;
  6. peak memory per step: the step's own peak plus the network's parameters and optimizer
     state (on a CPU with --memory: one more step of each case under the profiler, which
     records every allocation; torch's CPU allocator keeps no peak); with --largest, the
     most tokens a step of that backend fits (CUDA);
  7. with --grad-checkpointing, the packed batch again with every block recomputed in the
     backward (model.net.grad_checkpointing): its cost in time and what it saves in memory.
The cases of a model are timed in interleaved rounds (one step of each in turn), so that the
machine's drifts hit them alike; a summary under the table states the comparisons. On a CPU
the process keeps freed host memory as train.py's callbacks do, for every case and peer alike
(--release-host-memory: glibc's default).
Backends that cannot train here (varlen without an sm80+ GPU; flex on CPU, which has no
FlexAttention backward) are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from navit_lightning.batch import PackedBatch, PackedShape
from navit_lightning.bench import at_least_one, peers, train_config
from navit_lightning.bench.profile import (
    UNACCOUNTED,
    StepProfile,
    peak_host_bytes,
    profile_step,
    profile_table,
)
from navit_lightning.data.packing import ImageSample, first_fit_decreasing, pack
from navit_lightning.models import NaViT
from navit_lightning.models.attention import BACKENDS, SegmentsBackend, varlen_available
from navit_lightning.utils.host_memory import keep_freed_memory

ROW_LENGTHS = (256, 512, 1024, 2048)
# Issue 14's targets: real patches/s against the best peer, and model FLOP/s against the
# matmul probe (fp32 on a CPU).
PEER_TARGET = 1.5
MATMUL_SHARE_TARGET = 0.75


@dataclass
class Result:
    model: str
    layout: str  # packed | padded | scaling | checkpointed | peer
    backend: str
    compiled: bool
    row_len: int
    images: int
    real_tokens: int
    step_ms: float | None
    patches_per_s: float | None = None
    images_per_s: float | None = None
    tflops: float | None = None
    matmul_share: float | None = None
    peak_mib: float | None = None
    note: str = ""
    round_ms: list[float] = field(default_factory=list)  # the step of each interleaved round


def workload(tokens: int, sides: tuple[int, int] = (4, 16), seed: int = 0) -> list[tuple[int, int]]:
    """Image grids (h, w) in patches, sides within `sides`, aspect up to 2:1, drawn while they
    fill at most 98 % of `tokens` (about what the training packer reaches; every layout below
    still holds all of them)."""
    rng = random.Random(seed)
    low, high = sides
    grids: list[tuple[int, int]] = []
    while True:
        side = rng.randint(low, high)
        other = max(low, min(high, round(side * 2 ** rng.uniform(-1, 1))))
        grid = (side, other) if rng.random() < 0.5 else (other, side)
        if sum(h * w for h, w in grids) + grid[0] * grid[1] > 0.98 * tokens:
            return grids
        grids.append(grid)


def samples_for(grids: list[tuple[int, int]], patch_dim: int, seed: int = 0) -> list[ImageSample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, (h, w) in enumerate(grids):
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        pixels = torch.randint(0, 256, (h * w, patch_dim), generator=generator, dtype=torch.uint8)
        samples.append(ImageSample(pixels, torch.stack([ys.flatten(), xs.flatten()], 1), (h, w), i % 10))
    return samples


def scaling_row_lengths(longest: int) -> list[int]:
    """The ROW_LENGTHS whose rows hold an image of `longest` patches."""
    return [row_len for row_len in ROW_LENGTHS if row_len >= longest]


def packed_batch(samples: list[ImageSample], tokens: int, row_len: int, patch_dim: int) -> PackedBatch:
    """The samples in whole rows of `row_len` tokens, as many as `tokens` take, and more
    where first-fit-decreasing leaves images over (large images fill rows less)."""
    lengths = [len(s.patches) for s in samples]
    slots = row_len // min(lengths)  # as many image slots as the smallest image allows a row
    rows = -(-tokens // row_len)
    while left_over := first_fit_decreasing(lengths, PackedShape(rows, row_len, slots))[1]:
        rows += -(-sum(lengths[i] for i in left_over) // row_len)
    return pack(samples, PackedShape(rows, row_len, slots), patch_dim)


def padded_batch(samples: list[ImageSample], patch_dim: int) -> PackedBatch:
    """The same images at one square size, the nearest to the same total patch count, one
    per row."""
    side = round(math.sqrt(sum(len(s.patches) for s in samples) / len(samples)))
    square = samples_for([(side, side)] * len(samples), patch_dim, seed=1)
    return pack(square, PackedShape(rows=len(square), row_len=side * side, max_images=1), patch_dim)


class MatmulProbe:
    """The device's matmul rate: a large square matmul, timed in every round of the steps
    (a probe taken once, before them, moved by 25 % between runs on the CPU here). In
    nn.Linear's layout, x @ w.T: on a CPU without bf16 instructions a bf16 a @ b takes a slow
    path (1.5 GFLOP/s against a @ b.T's 36 on an AVX2 host) that the model's layers do not."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        n = 4096 if device.type == "cuda" else 1536
        self.a, self.b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        self.device, self.flops, self.seconds = device, 2 * n**3, []
        self._multiply()  # warm-up

    def _multiply(self) -> torch.Tensor:
        return self.a @ self.b.T

    def time(self) -> None:
        self.seconds += [timed_once(self._multiply, self.device) for _ in range(3)]

    @property
    def rate(self) -> float:
        """FLOP/s, from the median of every timing so far."""
        if not self.seconds:
            self.time()
        return self.flops / statistics.median(self.seconds)


def timed_once(step: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def architecture(model: str, overrides: list[str]) -> dict:
    """The network settings of a model config, with Hydra overrides (`model.net.depth=6`)."""
    cfg = train_config([f"model={model}", *overrides])
    arch = {k: v for k, v in cfg.model.net.items() if k != "_target_"}
    arch["max_grid"] = 64
    return arch


def pixels_per_patch(arch: dict) -> int:
    """The flattened patch length of an architecture (its patch_dim)."""
    return arch["patch_size"] ** 2 * arch["channels"]


@dataclass
class Trainer:
    """A network, its optimizer and one training step (forward, a loss on its outputs,
    backward, AdamW) on any input of its forward."""

    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[Any], None]

    def state_bytes(self) -> int:
        """Parameters and optimizer state: resident between steps."""
        tensors = [*self.net.parameters()] + [
            t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)


def trainer_for(
    net: torch.nn.Module,
    forward: Callable[[Any], torch.Tensor],
    device: torch.device,
    autocast: torch.dtype | None,
) -> Trainer:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step(inputs: Any) -> None:
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = forward(inputs).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainer(net, optimizer, step)


def make_trainer(
    arch: dict, backend: str, compiled: bool, device: torch.device, autocast: torch.dtype | None
) -> Trainer:
    torch.manual_seed(0)
    net = NaViT(**{**arch, "attention": backend}).to(device)
    compiled_net = torch.compile(net) if compiled else net
    return trainer_for(net, lambda batch: compiled_net(batch)[batch.image_slots], device, autocast)


@dataclass
class Case:
    """One figure: a batch through a trainer; its result is filled in once measured."""

    result: Result
    trainer: Trainer | None  # None: it cannot be built here (a peer not installed)
    batch: Any  # the input of the trainer's forward
    flops: float
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0


def measure_interleaved(
    cases: list[Case], device: torch.device, rounds: int, probe: MatmulProbe, host_memory: bool = False
) -> None:
    """One warm-up step per case (compiles; two for a compiled case), then `rounds` rounds of
    the matmul probe and one step of every case in turn: the machine's drifts hit every case
    and the probe alike. Figures from the median step; on a CPU with `host_memory`, the peak
    from one more step."""
    ready = []
    for case in cases:
        if case.trainer is None:  # could not be built here: its note says why
            continue
        try:
            case.trainer.step(case.batch)
            ready.append(case)
        except Exception as error:  # a backend that cannot run here is reported, not fatal
            case.result.note = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    # Compiled cases share the network's code: one compiled after another shows it new shapes,
    # and the first recompiles (with dynamic shapes) at its next step. A second warm-up step
    # of each compiled case keeps those recompiles out of the timed rounds.
    for case in ready:
        if case.result.compiled:
            case.trainer.step(case.batch)
    for _ in range(rounds):
        probe.time()
        for case in ready:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            case.seconds.append(timed_once(lambda case=case: case.trainer.step(case.batch), device))
            if device.type == "cuda":
                step_peak = torch.cuda.max_memory_allocated(device) - resident
                case.peak_bytes = max(case.peak_bytes, step_peak + case.trainer.state_bytes())
    for case in ready:
        if device.type == "cpu" and host_memory:
            peak = peak_host_bytes(lambda case=case: case.trainer.step(case.batch))
            case.peak_bytes = peak + case.trainer.state_bytes()
        r, seconds = case.result, statistics.median(case.seconds)
        r.step_ms = 1000 * seconds
        r.round_ms = [1000 * s for s in case.seconds]
        r.patches_per_s = r.real_tokens / seconds
        r.images_per_s = r.images / seconds
        r.tflops = case.flops / seconds / 1e12
        r.matmul_share = case.flops / seconds / probe.rate
        r.peak_mib = case.peak_bytes / 2**20 if case.peak_bytes else None


def model_cases(
    model: str,
    arch: dict,
    samples: list[ImageSample],
    args: argparse.Namespace,
    backends: list[str],
    device: torch.device,
    autocast: torch.dtype | None,
) -> list[Case]:
    """The packed, padded, scaling and peer cases of one model. Eager cases of a backend share
    one network (the step time does not depend on its weights); each compiled case has its own."""
    trainers: dict[tuple[str, bool, str], Trainer] = {}
    train_flops = NaViT(**arch).train_flops  # model FLOPs of a batch: the same for every layout

    def result(layout: str, backend: str, compiled: bool, row_len: int, batch: PackedBatch) -> Result:
        return Result(
            model=model,
            layout=layout,
            backend=backend,
            compiled=compiled,
            row_len=row_len,
            images=batch.num_images,
            real_tokens=batch.num_real_tokens,
            step_ms=None,
        )

    def case(layout: str, backend: str, compiled: bool, batch: PackedBatch) -> Case:
        checkpointed = layout == "checkpointed"
        key = (backend, compiled, layout if compiled or checkpointed else "")
        if key not in trainers:
            net_arch = {**arch, "grad_checkpointing": True} if checkpointed else arch
            trainers[key] = make_trainer(net_arch, backend, compiled, device, autocast)
        return Case(
            result(layout, backend, compiled, batch.patches.shape[1], batch),
            trainers[key],
            PackedBatch(*(t.to(device) for t in batch)),
            float(train_flops(batch)),
        )

    def peer_case(name: str, row_len: int, build: Callable[[], peers.Peer]) -> Case:
        """A peer on the packed batch's images; its row length is the one it packs or pads to."""
        record = result("peer", name, False, row_len, packed)
        try:
            net, forward, inputs = build()
        except Exception as error:  # not installed here, or not importable: reported, not fatal
            record.note = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            return Case(record, None, None, 0.0)
        return Case(record, trainer_for(net, forward, device, autocast), inputs, float(train_flops(packed)))

    patch_dim = samples[0].patches.shape[1]
    compile_modes = (False,) if args.no_compile else (False, True)
    packed = packed_batch(samples, args.tokens, args.row_len, patch_dim)
    padded = padded_batch(samples, patch_dim)
    cases = [case("packed", b, c, packed) for b in backends for c in compile_modes]
    if args.grad_checkpointing:
        cases += [case("checkpointed", b, False, packed) for b in backends]
    cases += [case("padded", "sdpa", c, padded) for c in compile_modes]
    longest = max(len(s.patches) for s in samples)
    row_lengths = scaling_row_lengths(longest)
    for row_len in row_lengths:
        batch = packed_batch(samples, max(args.tokens, row_len), row_len, patch_dim)
        cases += [case("scaling", b, False, batch) for b in backends]
    if "vit-pytorch" in args.peers:  # at every row length: its best is its users' best
        cases += [
            peer_case("vit-pytorch", g, lambda g=g: peers.vit_pytorch_navit(arch, samples, device, g))
            for g in row_lengths
        ]
    if "timm" in args.peers:
        cases.append(
            peer_case("timm-naflexvit", longest, lambda: peers.timm_naflexvit(arch, samples, device))
        )
    return cases


def summary(results: list[Result], nominal_peak: float | None = None) -> list[str]:
    """The comparisons the figures are for, one line each per model."""
    lines = []
    for model in dict.fromkeys(r.model for r in results):
        timed = [r for r in results if r.model == model and r.step_ms is not None]
        packed = [r for r in timed if r.layout == "packed"]
        dense = next((r for r in packed if r.backend == "sdpa" and not r.compiled), None)
        padded = max((r for r in timed if r.layout == "padded"), key=lambda r: r.images_per_s, default=None)
        if not packed:
            continue
        best = max(packed, key=lambda r: r.patches_per_s)
        name = f"{best.backend}{' compiled' if best.compiled else ''}"
        if dense:
            lines.append(
                f"{model}: best packed ({name}) {best.patches_per_s / dense.patches_per_s:.2f}x the "
                f"real patches/s of dense masked sdpa (eager)"
            )
        if padded:
            lines.append(
                f"{model}: best packed against the padded batch (its best, {padded.row_len} patches an "
                f"image): {best.images_per_s / padded.images_per_s:.2f}x its images/s, "
                f"{best.patches_per_s / padded.patches_per_s:.2f}x its patches/s"
            )
        for peer in dict.fromkeys(r.backend for r in timed if r.layout == "peer"):
            its_best = max((r for r in timed if r.backend == peer), key=lambda r: r.patches_per_s)
            ratio = best.patches_per_s / its_best.patches_per_s
            rounds = [
                best.real_tokens / ours * theirs / its_best.real_tokens
                for ours, theirs in zip(best.round_ms, its_best.round_ms, strict=True)
            ]
            lines.append(
                f"{model}: best packed ({name}) {ratio:.2f}x the real patches/s of {peer} at its best "
                f"(rows of {its_best.row_len} tokens{round_range(rounds, '{:.2f}x')}); "
                f"target {PEER_TARGET}x: {verdict(ratio >= PEER_TARGET)}"
            )
        for checkpointed in (r for r in timed if r.layout == "checkpointed"):
            plain = next((r for r in packed if r.backend == checkpointed.backend and not r.compiled), None)
            if plain is None:
                continue
            memory = (
                f", peak {plain.peak_mib:,.0f} -> {checkpointed.peak_mib:,.0f} MiB"
                if plain.peak_mib and checkpointed.peak_mib
                else ""
            )
            lines.append(
                f"{model}: {plain.backend} with grad checkpointing: "
                f"{checkpointed.step_ms / plain.step_ms:.2f}x the step time{memory}"
            )
        scaling = [r for r in timed if r.layout == "scaling"]
        for backend in dict.fromkeys(r.backend for r in scaling):
            steps = [r.step_ms for r in scaling if r.backend == backend]
            lengths = [r.row_len for r in scaling if r.backend == backend]
            lines.append(
                f"{model}: {backend} step time from {min(lengths)}- to {max(lengths)}-token rows: "
                f"{min(steps):.1f}..{max(steps):.1f} ms, spread {max(steps) / min(steps) - 1:.0%}"
            )
        longest = [r for r in scaling if r.row_len == ROW_LENGTHS[-1]]
        dense_longest = next((r for r in longest if r.backend == "sdpa"), None)
        if dense_longest and len(longest) > 1:
            fastest = min(longest, key=lambda r: r.step_ms)
            lines.append(
                f"{model}: at {ROW_LENGTHS[-1]}-token rows {fastest.backend} "
                f"{dense_longest.step_ms / fastest.step_ms:.2f}x the speed of dense masked sdpa"
            )
        fullest = max(packed, key=lambda r: r.matmul_share)
        share = fullest.matmul_share
        rounds = [share * fullest.step_ms / ms for ms in fullest.round_ms]
        of_peak = max(r.tflops for r in packed) * 1e12 / nominal_peak if nominal_peak else None
        lines.append(
            f"{model}: best share of the matmul probe {share:.0%}{round_range(rounds, '{:.0%}')} "
            f"(target {MATMUL_SHARE_TARGET:.0%}: {verdict(share >= MATMUL_SHARE_TARGET)})"
            + (f", of the device's nominal bf16 peak {of_peak:.0%}" if of_peak else "")
        )
    return lines


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def round_range(values: list[float], spec: str) -> str:
    """How far a figure moved from round to round (the host's noise; the figure itself is
    from the median step), where there was more than one round."""
    if len(values) < 2:
        return ""
    return f"; {spec.format(min(values))}..{spec.format(max(values))} round by round"


# Dense bf16 tensor-core peaks from the vendor's data sheets, by device name.
NOMINAL_BF16_PEAK = {"H100 80GB HBM3": 989.4e12, "H100 PCIe": 756.5e12, "H200": 989.4e12, "A100": 312e12}


def nominal_bf16_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in NOMINAL_BF16_PEAK.items() if key in name), None)


TABLE_HEAD = (
    "| model | layout | backend | compiled | row len | images | step ms | patches/s | images/s "
    "| TFLOP/s | of matmul | peak MiB | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_row(r: Result) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    return (
        f"| {r.model} | {r.layout} | {r.backend} | {'yes' if r.compiled else 'no'} | {r.row_len} "
        f"| {r.images} | {fmt(r.step_ms, '.1f')} | {fmt(r.patches_per_s, ',.0f')} "
        f"| {fmt(r.images_per_s, ',.1f')} | {fmt(r.tflops, '.3f')} | {fmt(r.matmul_share, '.0%')} "
        f"| {fmt(r.peak_mib, ',.0f')} | {r.note} |"
    )


def largest_batch(
    arch: dict, backend: str, args: argparse.Namespace, device: torch.device, autocast: torch.dtype | None
) -> str:
    """The most tokens a step takes on this device before it runs out of memory: doubling
    from --tokens, then halfway between the last that fit and the first that did not."""

    def fits(tokens: int) -> float | None:
        pixels = pixels_per_patch(arch)
        batch = packed_batch(samples_for(workload(tokens, args.sides), pixels), tokens, args.row_len, pixels)
        try:
            trainer = make_trainer(arch, backend, False, device, autocast)
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(2):
                trainer.step(PackedBatch(*(t.to(device) for t in batch)))
            return torch.cuda.max_memory_allocated(device) / 2**20
        except torch.OutOfMemoryError:
            return None
        finally:
            trainer = None
            torch.cuda.empty_cache()

    where = f"largest batch that fits ({backend}, {args.row_len}-token rows)"
    fitted, tokens = (args.tokens, fits(args.tokens)), args.tokens
    if fitted[1] is None:
        return f"{where}: none, not even --tokens {args.tokens}"
    while (peak := fits(tokens * 2)) is not None:
        tokens *= 2
        fitted = (tokens, peak)
    if (peak := fits(tokens * 3 // 2)) is not None:
        fitted = (tokens * 3 // 2, peak)
    return f"{where}: {fitted[0]} tokens, peak {fitted[1]:,.0f} MiB"


def profile_fastest(cases: list[Case], device: torch.device) -> dict[str, StepProfile]:
    """Profiles of the fastest packed case and of each peer at its best, by case name (none
    where no packed case ran)."""
    timed = [c for c in cases if c.result.step_ms is not None]
    packed = [c for c in timed if c.result.layout == "packed"]
    if not packed:
        return {}
    chosen = [min(packed, key=lambda c: c.result.step_ms)]
    for peer in dict.fromkeys(c.result.backend for c in timed if c.result.layout == "peer"):
        chosen.append(min((c for c in timed if c.result.backend == peer), key=lambda c: c.result.step_ms))
    named = {}
    for case in chosen:
        r = case.result
        name = f"{r.backend}{' compiled' if r.compiled else ''} ({r.row_len})"
        named[name] = profile_step(lambda case=case: case.trainer.step(case.batch), device)
    return named


def segment_groups(model: str, arch: dict, cases: list[Case], named: dict[str, StepProfile]) -> list[str]:
    """segments' groups per layer and, as an upper bound of its Python per group, the host
    time no op accounts for, shared out over its SDPA calls."""
    packed = next((c for c in cases if c.result.layout == "packed" and c.result.backend == "segments"), None)
    ours = next(iter(named.items()), None)
    if packed is None or ours is None or not ours[0].startswith("segments"):
        return []
    batch = packed.batch
    groups = len(SegmentsBackend().plan(batch.image_ids, batch.grid.shape[1]).buckets)
    calls = groups * arch["depth"]
    host_ms = ours[1].parts.get(UNACCOUNTED["cpu"])
    if host_ms is None:  # on a GPU the part without an op is the GPU's idle time
        return []
    return [
        f"{model}: segments attends in {groups} groups a layer, {calls} SDPA calls a forward; the host "
        f"time no op accounts for, {host_ms:.1f} ms a step, is at most {1000 * host_ms / calls:.0f} us "
        f"per group and layer (forward and backward)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["navit_tiny", "navit_small"])
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every model, e.g. model.net.depth=6",
    )
    parser.add_argument(
        "--backends", nargs="+", choices=sorted(BACKENDS), default=["sdpa", "segments", "flex", "varlen"]
    )
    parser.add_argument("--peers", nargs="*", default=["vit-pytorch", "timm"], help="other NaViTs to time")
    parser.add_argument("--tokens", type=at_least_one, default=4096, help="real-token budget of every step")
    parser.add_argument(
        "--sides", type=at_least_one, nargs=2, default=(4, 16), help="image sides in patches, min max"
    )
    parser.add_argument("--row-len", type=at_least_one, default=512, help="row length of the packed runs")
    parser.add_argument(
        "--steps",
        type=at_least_one,
        default=5,
        help="timed steps per figure, taken in interleaved rounds (median)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile runs")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast (a GPU, or a CPU with bf16 matrix units: AMX)"
    )
    parser.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="also the packed batch with every block recomputed in the backward",
    )
    parser.add_argument(
        "--memory", action="store_true", help="on a CPU, each case's peak memory (one profiled step a case)"
    )
    parser.add_argument("--largest", metavar="BACKEND", help="also find the most tokens a step fits (CUDA)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="where the ms of a step go (torch profiler): the fastest packed case, each peer at its best",
    )
    parser.add_argument(
        "--release-host-memory",
        action="store_true",
        help="on a CPU, leave glibc's allocator as it is (train.py keeps freed host memory)",
    )
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.bfloat16 if args.bf16 else None
    probe = MatmulProbe(device, autocast or torch.float32)
    nominal_peak = nominal_bf16_peak(device) if autocast == torch.bfloat16 else None
    usable = [
        b
        for b in args.backends
        if (b != "varlen" or varlen_available(device)) and (b != "flex" or device.type == "cuda")
    ]
    skipped = sorted(set(args.backends) - set(usable))
    if args.largest and device.type != "cuda":  # it doubles a batch until CUDA runs out: a host swaps first
        skipped.append("--largest (CUDA only)")
    if args.sides[0] > args.sides[1]:
        parser.error(f"--sides {args.sides[0]} {args.sides[1]}: give the smallest side first")
    grids = workload(args.tokens, args.sides)
    if not grids:
        parser.error(f"--tokens {args.tokens} holds no image of --sides {args.sides[0]} {args.sides[1]}")
    if args.sides[1] ** 2 > args.row_len:  # --largest draws larger workloads of the same sides
        parser.error(
            f"--row-len {args.row_len} is shorter than the largest image --sides draws "
            f"({args.sides[1]} x {args.sides[1]} patches): raise --row-len or lower --sides"
        )
    machine = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()}"
    )
    # The same allocator for every case and peer: a setting of the process.
    if device.type == "cpu" and not args.release_host_memory and keep_freed_memory():
        machine += ", freed host memory kept"
    workload_line = (
        f"{len(grids)} images ({args.sides[0]}..{args.sides[1]} patches a side), "
        f"{sum(h * w for h, w in grids)} patches a step"
        + (f"; overrides: {' '.join(args.set)}" if args.set else "")
        + (f"; skipped here: {', '.join(skipped)}" if skipped else "")
    )
    print(f"{machine}: {workload_line}", file=sys.stderr, flush=True)
    results: list[Result] = []
    extra: list[str] = []
    profiles: dict[str, dict[str, StepProfile]] = {}
    for model in args.models:
        arch = architecture(model, args.set)
        samples = samples_for(grids, pixels_per_patch(arch))
        cases = model_cases(model, arch, samples, args, usable, device, autocast)
        print(
            f"{model}: {len(cases)} cases, {args.steps} interleaved rounds ...", file=sys.stderr, flush=True
        )
        measure_interleaved(cases, device, args.steps, probe, args.memory)
        results += [case.result for case in cases]
        if args.profile and (named := profile_fastest(cases, device)):
            profiles[model] = named
            extra += segment_groups(model, arch, cases, named)
        del cases
        if args.largest and device.type == "cuda":
            extra.append(f"{model}: {largest_batch(arch, args.largest, args, device, autocast)}")
    lines = summary(results, nominal_peak) + extra
    header = (
        f"{time.strftime('%Y-%m-%d')}, {machine}, torch {torch.__version__}; matmul probe "
        f"{probe.rate / 1e12:.3f} TFLOP/s ({autocast or torch.float32}, median over the rounds); "
        + workload_line
    )
    table = "\n".join(
        [header, "", TABLE_HEAD, *map(markdown_row, results), "", *map("- {}".format, lines)]
        + [f"\n{model}, where a step's ms go:\n\n{profile_table(named)}" for model, named in profiles.items()]
    )
    print(table, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "matmul_flops": probe.rate,
                    "results": [asdict(r) for r in results],
                    "summary": lines,
                    "profiles": {
                        model: {name: asdict(p) for name, p in named.items()}
                        for model, named in profiles.items()
                    },
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
