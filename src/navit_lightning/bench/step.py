"""Where a training step's time goes: the config's step with no framework and inside
Lightning, measured in one run.

    python -m navit_lightning.bench.step [train.py overrides] [--steps N] [--warmup N]
        [--ablate] [--sync-steps N] [--json FILE]

bare:      forward, loss and backward of the config's model (compiled if model.compile), and
           every trainer.accumulate_grad_batches batches its gradient clipping (if any),
           optimizer and LR schedule, on batches collected from its loader beforehand (no
           loader running), under the trainer's precision and `trainer.deterministic`; timed
           before and after the Lightning runs, so that a drift of the machine shows.
bare with the loader: the same loop over the config's DataLoader, its workers running: what
           any training loop pays for decoding images on the same cores.
lightning: train.py's own datamodule, model, Trainer, callbacks and logger (`train.build`),
           timed from one training batch's start to the next: the loader, every hook and the
           logging included. Run it in a terminal, as users run train.py: the progress bar
           draws differently into a pipe.
--ablate:  the Lightning step again with one suspect at a time taken away, each against the
           bare step: what each one costs (those the config has).
syncs:     on a GPU, the Lightning run's device syncs a step by call site, counted over
           --sync-steps steps after the timed ones.
Every figure is a mean over --steps steps after --warmup steps.
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import math
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from omegaconf import OmegaConf

from navit_lightning.batch import PackedBatch, image_index
from navit_lightning.bench import at_least_one, train_config
from navit_lightning.errors import ConfigError, DataError
from navit_lightning.lit_module import NaViTClassifier, image_loss, parameter_groups
from navit_lightning.train import build
from navit_lightning.utils.callbacks import KeepFreedHostMemory
from navit_lightning.utils.entry_point import tidy_lightning_output

# The suspects of a Lightning step's overhead, each as the overrides that take it away.
SUSPECTS: dict[str, list[str]] = {
    "progress bar": ["callbacks.progress_bar=null"],
    "throughput monitor": ["callbacks.throughput=null"],
    "learning-rate monitor": ["callbacks.learning_rate_monitor=null"],
    "per-batch reports": ["callbacks.rank_step_report=null", "callbacks.unreadable_image_report=null"],
    # the learning-rate monitor refuses to run without a logger
    "logger": ["~logger", "callbacks.learning_rate_monitor=null"],
    "loader worker process": ["data.num_workers=0"],
    "deterministic algorithms": ["trainer.deterministic=false"],
}


class StepClock(L.Callback):
    """The start time of every training batch of `steps` after `warmup`; then, on a GPU, the
    device syncs of the `sync_steps` steps after those (implicit ones, through torch's sync
    debug mode, which slows the steps it watches), by call site. They are counted from one
    batch's start to the start of the batch after them: the end of the fit (its checkpoint,
    the callbacks' on_train_end) is no step's."""

    def __init__(self, warmup: int, steps: int, sync_steps: int = 0) -> None:
        self.warmup, self.steps, self.sync_steps = warmup, steps, sync_steps
        self.starts: list[float] = []
        self.sync_sites: collections.Counter[str] = collections.Counter()
        self.show_warning: Callable[..., None] | None = None  # while syncs are counted
        self.warning_filters: list[Any] = []

    @property
    def batches(self) -> int:
        """The batches the run must start: the timed steps' and one more, whose start ends
        the last; then the watched steps' and one more."""
        return self.warmup + self.steps + 1 + (self.sync_steps + 1 if self.sync_steps else 0)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        first_watched = self.warmup + self.steps + 2
        if len(self.starts) == first_watched + self.sync_steps:
            self._stop_counting()
        elif (
            len(self.starts) == first_watched
            and self.sync_steps
            and trainer.strategy.root_device.type == "cuda"
        ):
            torch.cuda.set_sync_debug_mode("warn")
            self.warning_filters = list(warnings.filters)
            warnings.simplefilter("always")
            self.show_warning, warnings.showwarning = warnings.showwarning, self._count_sync

    def on_train_end(self, *args: Any) -> None:
        self._stop_counting()

    def _stop_counting(self) -> None:
        if self.show_warning is not None:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, self.show_warning = self.show_warning, None
            warnings.filters[:] = self.warning_filters

    def _count_sync(self, message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "synchronizing CUDA operation" not in str(message):
            self.show_warning(message, *args, **kwargs)
            return
        # the innermost frame of this project or Lightning: where to look
        ours = [
            frame
            for frame in traceback.extract_stack()[:-1]
            if ("navit_lightning" in frame.filename and "bench" not in frame.filename)
            or "lightning" in frame.filename
        ]
        frame = ours[-1] if ours else traceback.extract_stack()[-2]
        self.sync_sites[f"{frame.filename.rsplit('/', 3)[-1]}:{frame.lineno} {frame.name}"] += 1

    def mean_ms(self) -> float:
        starts = self.starts[self.warmup : self.warmup + self.steps + 1]
        return (starts[-1] - starts[0]) / (len(starts) - 1) * 1e3

    def syncs_per_step(self) -> dict[str, float]:
        return {site: count / self.sync_steps for site, count in self.sync_sites.most_common()}


def lightning_step(overrides: list[str], warmup: int, steps: int, sync_steps: int = 0) -> StepClock:
    """A Lightning training run of train.py's trainer for `overrides`, clocked, then
    `sync_steps` more with their device syncs counted (on a GPU)."""
    clock = StepClock(warmup, steps, sync_steps)
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = train_config([*overrides, f"paths.output_dir={output_dir}", "trainer.max_epochs=-1"])
        # the clock counts batches, trainer.max_steps optimizer steps
        cfg.trainer.max_steps = math.ceil(clock.batches / cfg.trainer.get("accumulate_grad_batches", 1))
        datamodule, model, trainer = build(cfg, [clock])
        trainer.fit(model, datamodule=datamodule)
    return clock


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
    # in the trainer's precision (bf16-true: the weights in bfloat16, as Lightning converts them)
    model = (
        trainer.precision_plugin.convert_module(copy.deepcopy(model)).to(trainer.strategy.root_device).train()
    )
    if cfg.model.get("compile"):
        model.net.compile()  # as the LightningModule's setup does for a fit
    optimizer = hydra.utils.instantiate(cfg.optimizer)(params=parameter_groups(model))
    scheduler = hydra.utils.instantiate(cfg.scheduler)(optimizer, warmup + steps)
    accumulated, clip = trainer.accumulate_grad_batches, trainer.gradient_clip_val
    times, start = [], time.perf_counter()
    for index_in_run, batch in enumerate(itertools.islice(batches, warmup + steps)):
        num_images = batch.num_images  # on the host, as the LightningModule counts it
        batch = move_data_to_device(batch, trainer.strategy.root_device)
        index = image_index(batch, num_images)
        with trainer.precision_plugin.forward_context():
            loss = image_loss(model(batch, index), batch.labels.flatten()[index])
        loss.backward()
        if (index_in_run + 1) % accumulated == 0:
            if clip:
                clip_gradients = (
                    torch.nn.utils.clip_grad_value_
                    if trainer.gradient_clip_algorithm == "value"
                    else torch.nn.utils.clip_grad_norm_
                )
                clip_gradients(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if batch.image_ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    return statistics.fmean(times[warmup:]) * 1e3


def measure(
    overrides: list[str], steps: int, warmup: int, ablate: bool, sync_steps: int = 20
) -> dict[str, float]:
    """Step times in ms: bare (before and after), lightning, and `without <suspect>`."""
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = train_config([*overrides, f"paths.output_dir={output_dir}"])
        datamodule, model, trainer = build(cfg)
        for logger in trainer.loggers:  # done writing (the run's hparams) before the folder goes
            logger.finalize("success")
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if trainer.world_size > 1:
        raise ConfigError("the step benchmark runs one process: pass trainer.devices=1 and strategy=auto")
    # The process as the first Lightning run leaves it, for the bare steps before it too: the
    # allocator setting lasts for the process.
    for callback in trainer.callbacks:
        if isinstance(callback, KeepFreedHostMemory):
            callback.setup(trainer, model, "fit")
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    between_validations = batches_between_validations(trainer, len(loader))
    on_gpu = trainer.strategy.root_device.type == "cuda"
    sync_steps = sync_steps if on_gpu else 0  # CUDA's syncs
    needed = StepClock(warmup, steps, sync_steps).batches
    if between_validations < needed:  # the Lightning run would take one in
        raise ConfigError(
            f"--warmup {warmup} and --steps {steps} need {needed} training "
            f"batches between validations, and these settings give {between_validations}: lower them, "
            "or give more images"
        )
    batches = list(itertools.islice(loader, warmup + steps))
    del loader

    figures: dict[str, float] = {}

    def record(name: str, ms: float) -> None:
        figures[name] = ms
        print(f"step benchmark: {name} {ms:.1f} ms", flush=True)  # amid Lightning's output

    if cfg.model.get("compile"):  # compiled here, untimed: the later runs find it compiled
        bare_step_ms(model, trainer, cfg, batches, warmup, steps)
    record("bare_before", bare_step_ms(model, trainer, cfg, batches, warmup, steps))
    loader = datamodule.train_dataloader()  # the same loader, iterated from the epoch's start again
    record("bare_with_loader", bare_step_ms(model, trainer, cfg, loader, warmup, steps))
    del loader
    datamodule.teardown("fit")  # its workers end before the Lightning runs
    clock = lightning_step(overrides, warmup, steps, sync_steps)
    record("lightning", clock.mean_ms())
    for site, per_step in clock.syncs_per_step().items():
        figures[f"syncs {site}"] = per_step
    if ablate:
        suspects = suspects_in(cfg)
        if untimed := sorted(SUSPECTS.keys() - suspects.keys()):
            print(f"step benchmark: nothing to take away in this config: {', '.join(untimed)}")
        for suspect, taken_away in suspects.items():
            record(f"without {suspect}", lightning_step([*overrides, *taken_away], warmup, steps).mean_ms())
        every_suspect = [o for taken_away in suspects.values() for o in taken_away]
        record("without all of them", lightning_step([*overrides, *every_suspect], warmup, steps).mean_ms())
    torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])  # as at the start
    record("bare_after", bare_step_ms(model, trainer, cfg, batches, warmup, steps))
    figures["bare"] = (figures["bare_before"] + figures["bare_after"]) / 2
    return figures


def batches_between_validations(trainer: L.Trainer, loader_batches: int) -> int:
    """The training batches from an epoch's start to its first validation or its end, as
    Lightning counts them: trainer.limit_train_batches (set by debug=limit, debug=fdr and
    debug=overfit too) and trainer.val_check_interval, each a count or a share."""
    if trainer._val_check_time_interval is not None:
        raise ConfigError(
            f"a timed trainer.val_check_interval (every {trainer._val_check_time_interval:g} s) validates "
            "by the clock, maybe within the timed steps: give a count of batches, or leave it out"
        )

    def counted(limit: int | float, batches: int) -> int:
        return min(limit, batches) if isinstance(limit, int) else int(limit * batches)

    epoch = counted(trainer.limit_train_batches, loader_batches)
    return counted(trainer.val_check_interval, epoch)


def suspects_in(cfg: Any) -> dict[str, list[str]]:
    """The SUSPECTS the config has, each with those of its overrides that take something away:
    Hydra refused to set what is not there (callbacks=none has no progress bar, nor the
    learning-rate monitor the logger's removal takes along), and a setting the config gives
    already (data.num_workers=0) took a whole Lightning run to change nothing."""
    absent = object()

    def takes_away(override: str) -> bool:
        key, _, value = override.lstrip("~").partition("=")
        found = OmegaConf.select(cfg, key, default=absent)
        if value in ("", "null"):  # a callback or a logger: there when set
            return found is not absent and found is not None
        return found is not absent and str(found).lower() != value

    return {
        suspect: [override for override in taken_away if takes_away(override)]
        for suspect, taken_away in SUSPECTS.items()
        if takes_away(taken_away[0])
    }


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
    syncs = {name.removeprefix("syncs "): n for name, n in figures.items() if name.startswith("syncs ")}
    if syncs:
        lines.append(f"device syncs a Lightning step (implicit, CUDA): {sum(syncs.values()):.2f}")
        lines += [f"  {per_step:5.2f}  {site}" for site, per_step in syncs.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="train.py config overrides")
    parser.add_argument("--steps", type=at_least_one, default=60, help="steps timed (default 60)")
    # at least one: the first batch draws the pictures of its epoch, which the bare loop does not
    parser.add_argument("--warmup", type=at_least_one, default=5, help="steps before timing (default 5)")
    parser.add_argument("--sync-steps", type=int, default=20, help="GPU steps syncs are counted in (0: none)")
    parser.add_argument("--ablate", action="store_true", help="time the step without each suspect")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    tidy_lightning_output()
    try:
        figures = measure(args.overrides, args.steps, args.warmup, args.ablate, args.sync_steps)
    except (ConfigError, DataError) as error:  # settings the benchmark cannot time, data it cannot read
        parser.error(str(error))
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
