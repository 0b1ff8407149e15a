"""Does the data path keep up? Packing quality, loader throughput and what a training step
consumes, measured in one run on this machine.

    python -m navit_lightning.bench.data_loading [train.py overrides] [--batches N] [--json FILE]

It composes the same config as train.py (so `data=imagefolder data.root=DIR`, `model=...`,
`data.num_workers=...` all apply) and prints:
  - plan: fill (real tokens / capacity; with and without the epoch's last, partial batch),
    mean images per batch, planning time per batch;
  - loader: images/s and tokens/s delivered by the DataLoader with its workers;
  - train step: images/s and tokens/s that train.py's step (forward, backward, clipping, the
    optimizer and schedule, on the config's device and precision) consumes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import hydra
from omegaconf import open_dict

from navit_lightning.bench import at_least_one, train_config
from navit_lightning.bench.step import bare_step_ms
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.errors import ConfigError, DataError
from navit_lightning.utils.entry_point import tidy_lightning_output
from navit_lightning.utils.validate import check_launch


def measure(overrides: list[str], batches: int) -> dict[str, float]:
    cfg = train_config(overrides)
    check_launch(cfg)  # train.py's refusals: trainer.accelerator=gpu without one was a traceback
    trainer = hydra.utils.instantiate(
        cfg.trainer, default_root_dir=None, logger=False, callbacks=[], enable_checkpointing=False
    )
    if trainer.world_size > 1:  # a rank's loader has fewer workers: data.num_workers=null shares the cores
        raise ConfigError(
            "the data benchmark runs one process's loader: pass trainer.devices=1 and strategy=auto, "
            "and the data.num_workers of one rank"
        )
    datamodule: PackedImageDataModule = hydra.utils.instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    shape = datamodule.shape

    start = time.perf_counter()
    plan = datamodule.batch_sampler("train").plan_stats()
    plan_seconds = (time.perf_counter() - start) / plan.batches

    loader = datamodule.train_dataloader()
    collected, images, tokens = [], 0, 0
    iterator = iter(loader)
    collected.append(next(iterator))  # worker start-up is not throughput
    start = time.perf_counter()
    for batch in iterator:
        collected.append(batch)
        images += batch.num_images
        tokens += batch.num_real_tokens
        if len(collected) > batches:
            break
    loader_seconds = time.perf_counter() - start
    del iterator
    if len(collected) < 2:  # the first is the workers' start-up
        raise ConfigError(
            f"the training epoch holds {len(collected)} batch: the figures need 2 or more, from more "
            "images or fewer data.rows"
        )

    with open_dict(cfg):
        cfg.model.num_classes = datamodule.num_classes
    model = hydra.utils.instantiate(cfg.model)
    # train.py's step on its device and precision (bench.step's bare step); the first batch
    # warms up the allocator
    step_seconds = bare_step_ms(model, trainer, cfg, collected, warmup=1, steps=len(collected) - 1) / 1e3
    measured = collected[1:]
    mean_images = sum(b.num_images for b in measured) / len(measured)
    mean_tokens = sum(b.num_real_tokens for b in measured) / len(measured)
    return {
        "rows": shape.rows,
        "row_len": shape.row_len,
        "fill": plan.fill,
        "fill_but_last": plan.fill_but_last,
        "images_per_batch_mean": plan.images_per_batch,
        "plan_ms_per_batch": plan_seconds * 1e3,
        "num_workers": loader.num_workers,
        "loader_images_per_s": images / loader_seconds,
        "loader_tokens_per_s": tokens / loader_seconds,
        "train_step_ms": step_seconds * 1e3,
        "train_images_per_s": mean_images / step_seconds,
        "train_tokens_per_s": mean_tokens / step_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="train.py config overrides")
    parser.add_argument("--batches", type=at_least_one, default=30, help="batches to time (default 30)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    tidy_lightning_output()
    try:
        f = measure(args.overrides, args.batches)
    except (ConfigError, DataError) as error:  # settings it cannot time, data it cannot read
        parser.error(str(error))
    print(
        f"plan:       {f['rows']} rows x {f['row_len']} tokens, fill {f['fill']:.1%} "
        f"({f['fill_but_last']:.1%} without the epoch's last batch), "
        f"{f['images_per_batch_mean']:.1f} images per batch, "
        f"{f['plan_ms_per_batch']:.2f} ms to plan a batch\n"
        f"loader:     {f['loader_images_per_s']:.0f} images/s, {f['loader_tokens_per_s']:.0f} tokens/s "
        f"({f['num_workers']} workers)\n"
        f"train step: {f['train_images_per_s']:.0f} images/s, {f['train_tokens_per_s']:.0f} tokens/s "
        f"({f['train_step_ms']:.0f} ms a step)\n"
        f"the loader delivers {f['loader_images_per_s'] / f['train_images_per_s']:.1f}x what the training "
        "step consumes"
    )
    if args.json:
        args.json.write_text(json.dumps(f, indent=2))


if __name__ == "__main__":
    main()
