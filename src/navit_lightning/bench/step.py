"""Where a training step's time goes: the config's step with no framework and inside
Lightning, measured in one run.

    python -m navit_lightning.bench.step [train.py overrides] [--steps N] [--warmup N]
        [--ablate] [--json FILE]

bare:      forward, loss, backward, gradient clipping, AdamW and the LR schedule of the
           config's model on batches collected from its loader beforehand (no loader
           running), under the trainer's precision and `trainer.deterministic`; timed before
           and after the Lightning runs, so that a drift of the machine shows.
bare with the loader: the same loop over the config's DataLoader, its workers running: what
           any training loop pays for decoding images on the same cores.
lightning: train.py's own datamodule, model, Trainer, callbacks and logger (`train.build`),
           timed from one training batch's start to the next: the loader, every hook and the
           logging included. Run it in a terminal, as users run train.py: the progress bar
           draws differently into a pipe.
--ablate:  the Lightning step again with one suspect at a time taken away, each against the
           bare step: what each one costs.
Every figure is a mean over --steps steps after --warmup steps.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from navit_lightning.bench import train_config
from navit_lightning.data.packing import PackedBatch
from navit_lightning.lit_module import NaViTClassifier, image_loss, parameter_groups
from navit_lightning.train import build
from navit_lightning.utils.entry_point import tidy_lightning_output

# The suspects of a Lightning step's overhead, each as the overrides that take it away.
SUSPECTS: dict[str, list[str]] = {
    "progress bar": ["callbacks.progress_bar=null"],
    "throughput monitor": ["callbacks.throughput=null"],
    "learning-rate monitor": ["callbacks.learning_rate_monitor=null"],
    "per-batch reports": ["callbacks.rank_step_report=null", "callbacks.unreadable_image_report=null"],
    # the learning-rate monitor refuses to run without a logger
    "TensorBoard logger": ["~logger", "callbacks.learning_rate_monitor=null"],
    "loader worker process": ["data.num_workers=0"],
    "deterministic algorithms": ["trainer.deterministic=false"],
}


class StepClock(L.Callback):
    """The start time of every training batch."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def mean_ms(self, warmup: int) -> float:
        starts = self.starts[warmup:]
        return (starts[-1] - starts[0]) / (len(starts) - 1) * 1e3


def lightning_step_ms(overrides: list[str], warmup: int, steps: int) -> float:
    """Mean time of a Lightning training step of train.py's trainer for `overrides`."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as output_dir:
        run = [
            *overrides,
            f"paths.output_dir={output_dir}",
            f"trainer.max_steps={warmup + steps + 1}",
            "trainer.max_epochs=-1",  # as many epochs as the steps take
        ]
        datamodule, model, trainer = build(train_config(run), [clock])
        trainer.fit(model, datamodule=datamodule)
    return clock.mean_ms(warmup)


def bare_step_ms(
    model: NaViTClassifier,
    trainer: L.Trainer,
    cfg: Any,
    batches: Iterable[PackedBatch],
    warmup: int,
    steps: int,
) -> float:
    """Mean time of the same training step written out with no framework, from one batch's
    arrival to the next one's (the wait for the loader included, when it is one)."""
    model = copy.deepcopy(model).to(trainer.strategy.root_device).train()
    optimizer = hydra.utils.instantiate(cfg.optimizer)(params=parameter_groups(model))
    scheduler = hydra.utils.instantiate(cfg.scheduler)(optimizer, warmup + steps)
    times, start = [], time.perf_counter()
    for batch in itertools.islice(batches, warmup + steps):
        batch = move_data_to_device(batch, trainer.strategy.root_device)
        with trainer.precision_plugin.forward_context():
            loss = image_loss(model(batch), batch.labels[batch.image_slots])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if batch.image_ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    return statistics.fmean(times[warmup:]) * 1e3


def measure(overrides: list[str], steps: int, warmup: int, ablate: bool) -> dict[str, float]:
    """Step times in ms: bare (before and after), lightning, and `without <suspect>`."""
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = train_config([*overrides, f"paths.output_dir={output_dir}"])
        datamodule, model, trainer = build(cfg)
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if trainer.world_size > 1:
        raise ValueError("the step benchmark runs one process: pass trainer.devices=1 and strategy=auto")
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    batches = [next(loader) for _ in range(warmup + steps)]
    del loader

    figures: dict[str, float] = {}

    def record(name: str, ms: float) -> None:
        figures[name] = ms
        print(f"step benchmark: {name} {ms:.1f} ms", flush=True)  # amid Lightning's output

    record("bare_before", bare_step_ms(model, trainer, cfg, batches, warmup, steps))
    loader = datamodule.train_dataloader()  # a fresh one: its workers start from the top
    record("bare_with_loader", bare_step_ms(model, trainer, cfg, loader, warmup, steps))
    del loader
    record("lightning", lightning_step_ms(overrides, warmup, steps))
    if ablate:
        for suspect, taken_away in SUSPECTS.items():
            record(f"without {suspect}", lightning_step_ms([*overrides, *taken_away], warmup, steps))
        every_suspect = [o for taken_away in SUSPECTS.values() for o in taken_away]
        record("without all of them", lightning_step_ms([*overrides, *every_suspect], warmup, steps))
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])  # as at the start
    record("bare_after", bare_step_ms(model, trainer, cfg, batches, warmup, steps))
    figures["bare"] = (figures["bare_before"] + figures["bare_after"]) / 2
    return figures


def report(figures: dict[str, float]) -> str:
    bare = figures["bare"]
    lines = [
        f"{'bare step (no framework, no loader):':45s}{bare:7.1f} ms "
        f"(before the Lightning runs {figures['bare_before']:.1f}, after {figures['bare_after']:.1f})",
        f"{'bare step with the loader running:':45s}{figures['bare_with_loader']:7.1f} ms, "
        f"{figures['bare_with_loader'] / bare - 1:+6.1%} over bare",
    ]
    for name, ms in figures.items():
        if name == "lightning" or name.startswith("without "):
            label = "Lightning step (train.py's trainer)" if name == "lightning" else f"  {name}"
            lines.append(
                f"{label + ':':45s}{ms:7.1f} ms, {ms / bare - 1:+6.1%} over bare, "
                f"{ms / figures['bare_with_loader'] - 1:+6.1%} over bare with the loader"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="train.py config overrides")
    parser.add_argument("--steps", type=int, default=60, help="steps timed (default 60)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (default 5)")
    parser.add_argument("--ablate", action="store_true", help="time the step without each suspect")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    tidy_lightning_output()
    figures = measure(args.overrides, args.steps, args.warmup, args.ablate)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
