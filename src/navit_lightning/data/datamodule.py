"""One LightningDataModule for the built-in shapes and for the user's own image folder."""

from __future__ import annotations

import math
import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.utils.data import DataLoader

from navit_lightning.batch import PackedShape
from navit_lightning.data import shapes
from navit_lightning.data.folder import (
    ImageFolder,
    check_class_folders,
    check_every_class_readable,
    classes_line,
    find_classes,
    folder_layout,
    hold_out,
    images_of_files,
    left_out,
    paths_layout,
    split_images,
    unevaluated_classes,
    warn_unreadable,
    within_pixels,
)
from navit_lightning.data.index import Manifest, index_folder, manifest_path
from navit_lightning.data.packing import PackCollate
from navit_lightning.data.sampler import PackedBatchSampler, SizePolicy
from navit_lightning.data.shards import load_shards, shard_classes
from navit_lightning.data.transforms import PILLOW_MAX_PIXELS, longest_side
from navit_lightning.data.workers import loader_context, loader_worker_init, usable_cores
from navit_lightning.errors import ConfigError, DataError, require_counts, require_flags
from navit_lightning.utils.launch import srun_tasks
from navit_lightning.utils.schedules import limited, step_factors

# What one optimizer step consumes, logged at the start of training (see _report_effective_batch).
EFFECTIVE_BATCH_METRICS = ("effective_batch/tokens", "effective_batch/images")

# Every rank reads the same lists of files: rank zero names the unreadable ones.
warn_unreadable_on_rank_zero = rank_zero_only(warn_unreadable)


def held_weakly(method: Callable[[], int | None]) -> Callable[[], int | None]:
    """`method` of a datamodule its loader holds, without keeping the datamodule alive; 0 once
    it is gone (a datamodule no trainer held, so none was attached: what `method` gave). Held
    strongly, the two made a cycle, which the garbage collector ended in an order that broke
    torch's shutdown of the loader's persistent workers (10 s a worker, then left running)."""
    reference = weakref.WeakMethod(method)
    return lambda: 0 if (bound := reference()) is None else bound()


def seed_of_split(split_seed: int | None, seed: int) -> int:
    """What holds the val images out: `split_seed`, or where it is None the run's `seed`, as
    every run did before split_seed existed (their checkpoints hold none, and a resume or
    eval.py must hold out the same images from them)."""
    return seed if split_seed is None else split_seed


class NamingLoader(DataLoader):
    """A loader of an ImageFolder that names each file failing to decode in this process, as
    the batches come (ImageFolder.name_new_failures), whatever the callbacks."""

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self.dataset.name_new_failures()
            yield batch
        self.dataset.name_new_failures()


class TrainLoader(NamingLoader):
    """The training loader, resumable mid-epoch through Lightning's `_Stateful` protocol
    (its state goes into every checkpoint): the epoch, and how many of its batches the
    training step finished on every rank, which `batches_done` reports. The loader cannot
    count them itself: its workers and Lightning's fetcher read batches ahead."""

    def __init__(
        self,
        *args: Any,
        batches_done: Callable[[], int | None],
        epochs_ended: Callable[[], int],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done
        self.epochs_ended = epochs_ended

    def __iter__(self) -> Iterator[Any]:
        # Lightning calls iter() twice at the start of every epoch after the first (FitLoop.
        # setup_data, where it asks for the loaders again, then the epoch loop's start) and
        # drops the first iterator. Started at once, the workers would decode batches for
        # nothing, and count their failures twice.
        def started_at_first_batch() -> Iterator[Any]:
            yield from super(TrainLoader, self).__iter__()

        return started_at_first_batch()

    def state_dict(self) -> dict[str, Any]:
        sampler = self.batch_sampler
        done = self.batches_done()  # None: every batch of the epoch
        if done is None:
            return sampler.position(len(sampler), epoch_ended=self.epochs_ended() > sampler.sampler.epoch)
        return sampler.position(done)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batch_sampler.resume(state_dict)


class PackedImageDataModule(L.LightningDataModule):
    """Class-folder images at native resolution, packed into fixed-shape token batches.

    `root` holds <class>/ folders, or train/ and val/ (and optionally test/) each holding them;
    without val/ a `val_fraction` of the images is held out, drawn by `split_seed` (from each
    image's path with `split_by_path`, as the configs set it; see folder.hold_out); with
    `evaluate_all` (eval.py on a folder no run trained on) none is: a root of <class>/
    folders is all val and test, and val/ or test/ need no train/. With `generate` set, the
    built-in shapes set is written to `root` first (once, on one process per node).
    Every image's size comes from the folder's manifest (data/index.py), brought up to date
    on one process per node; it lies in `root`, or in `index_dir` if given. With `shards`,
    `root` holds tar shards of such a folder (data/shards.py) and their manifest.
    """

    def __init__(
        self,
        root: str,
        patch_size: int = 16,
        max_patches: int = 256,
        min_patches: int | None = None,
        token_drop_rate: float = 0.0,
        token_drop_beta: tuple[float, float] | None = None,
        token_drop_by_resolution: bool = False,
        rows: int = 16,
        row_len: int = 256,
        max_images_per_row: int = 16,
        lookahead: int = 512,
        val_fraction: float = 0.1,
        hflip: float = 0.5,
        num_workers: int | None = None,
        multiprocessing_context: str | None = "forkserver",
        pin_memory: bool = True,
        seed: int = 0,
        split_seed: int | None = None,
        split_by_path: bool = False,
        generate: shapes.ShapesSpec | None = None,
        index_dir: str | None = None,
        shards: bool = False,
        evaluate_all: bool = False,
        max_image_pixels: int | None = PILLOW_MAX_PIXELS,
    ) -> None:
        super().__init__()
        require_counts(
            "data",
            patch_size=patch_size,
            max_patches=max_patches,
            rows=rows,
            row_len=row_len,
            max_images_per_row=max_images_per_row,
            lookahead=lookahead,
            max_image_pixels=max_image_pixels,
        )
        require_flags(
            "data",
            token_drop_by_resolution=token_drop_by_resolution,
            pin_memory=pin_memory,
            split_by_path=split_by_path,
            shards=shards,
        )
        if num_workers is not None and num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} must be 0 (load in this process) or more")
        if not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction} is the share of images held out: 0 < it < 1")
        if not 0 <= hflip <= 1:
            raise ConfigError(f"data.hflip={hflip} is a probability: 0 <= it <= 1")
        self.root = Path(root).expanduser()  # data.root='~/images': neither shell nor Hydra expands it
        if generate is not None:  # refused before the run starts, as well as where it writes
            shapes.refuse_a_folder_of_other_files(self.root)
        self.patch_size = patch_size
        # Training sizes vary (variable resolution, token dropping); evaluation's: see policy.
        self.train_policy = SizePolicy(
            patch_size,
            max_patches,
            min_patches=min_patches,
            drop_rate=token_drop_rate,
            drop_beta=token_drop_beta,
            drop_by_resolution=token_drop_by_resolution,
        )
        # Per device; see process_shape.
        self.shape = PackedShape(rows, row_len, max_images_per_row)
        # The patch budgets of the evaluation loaders, one loader each (see evaluate_at);
        # None: data.max_patches (see policy).
        self.eval_budgets: tuple[int | None, ...] = (None,)
        self.lookahead = lookahead
        self.val_fraction = val_fraction
        self.hflip = hflip
        self.num_workers = num_workers
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory = pin_memory
        self.seed = seed
        self.split_seed = seed_of_split(split_seed, seed)
        self.split_by_path = split_by_path  # False: as runs from before it held out
        self.generate = generate
        self.index_dir = index_dir
        self.shards = shards
        self.evaluate_all = evaluate_all
        self.max_image_pixels = max_image_pixels
        if multiprocessing_context not in (None, *multiprocessing.get_all_start_methods()):
            raise DataError(
                f"data.multiprocessing_context={multiprocessing_context!r} is unknown: use one of "
                f"{multiprocessing.get_all_start_methods()}"
            )
        if max_patches > row_len:
            raise DataError(
                f"data.max_patches={max_patches} exceeds data.row_len={row_len}: "
                "an image would not fit a row; raise data.row_len or lower data.max_patches"
            )
        self.datasets: dict[str, ImageFolder] = {}
        self._compared_across_ranks = False  # see _refuse_other_images_on_other_ranks
        self.predict_paths: list[Path] = []
        self._indexed = False
        self._train_position: dict[str, Any] | None = None  # from a checkpoint, for train_dataloader
        self._reported = False  # the effective batch, printed with the first train loader
        self._loaders: dict[str, tuple[tuple, DataLoader]] = {}  # split -> (made for, loader)

    def hold_out_as(self, run_data: Mapping[str, Any]) -> dict[str, Any]:
        """Hold out the images that the run of `run_data` (a checkpoint's data config) held
        out, which a resume, a test or an evaluation of it must keep, naming the settings
        of this config left aside for it: a run from before split_seed or split_by_path
        held out by its seed, by a shuffle. Returns the settings held out by."""
        held_out = {
            "val_fraction": run_data.get("val_fraction", self.val_fraction),
            "split_seed": seed_of_split(run_data.get("split_seed"), run_data.get("seed", self.seed)),
            "split_by_path": run_data.get("split_by_path", False),
        }
        left_aside = {key: value for key, value in held_out.items() if getattr(self, key) != value}
        if left_aside:
            given = ", ".join(f"data.{key}={getattr(self, key)}" for key in left_aside)
            run = ", ".join(f"{key}={value}" for key, value in left_aside.items())
            rank_zero_warn(
                f"{given} left aside: the checkpoint's run held out {run}, and its images are held out again"
            )
        for key, value in held_out.items():
            setattr(self, key, value)
        return held_out

    @property
    def num_classes(self) -> int:
        return len(self.class_names())

    def class_names(self) -> list[str]:
        """The class folders of the training images, in label order; refuses a root that
        cannot train. The built-in set's are known before it is generated."""
        if self.generate is not None:
            return sorted(shapes.CLASSES)  # the folder names, sorted as find_classes does
        if self.shards:
            return shard_classes(self.root)
        layout = folder_layout(self.root, need_train=not self.evaluate_all)
        class_root = self.root / layout.get("train", next(iter(layout.values())))
        classes = find_classes(class_root)
        check_class_folders(class_root, classes)
        return classes

    def prepare_data(self) -> None:
        if self.predict_paths:  # predict.py reads its input files, not data.root
            return
        if self.generate is not None:
            shapes.generate(self.root, self.generate, workers=usable_cores())
        # once per process: fit, then test and validate call this again
        if not self._indexed and not self.shards:
            self.class_names()  # a root that cannot train is refused before it is indexed
            index_folder(self.root, self.index_dir, usable_cores(), name_others=self.generate is None)
            self._indexed = True

    def predict_on(self, paths: list[Path]) -> None:
        """The image files `predict_dataloader` serves (its stage does not read data.root).
        Their batches carry each image's position in `paths` where others carry its class."""
        self.predict_paths = paths
        self.datasets.pop("predict", None)

    def setup(self, stage: str) -> None:
        if stage == "predict":
            self._setup_predict()
            return
        if self.datasets:  # set up before the trainer was attached (a budget check), maybe
            self._refuse_other_images_on_other_ranks()
            return
        classes = self.class_names()
        manifest, layout = self._manifest()
        splits, loose = {}, {}
        for split, folder in layout.items():
            images, unreadable, loose[folder] = split_images(manifest, self.root, folder, classes)
            if not len(images.labels) and not unreadable:  # class folders, all empty
                raise DataError(
                    f"{self.root / folder} holds no images: put them in its class folders, or remove it"
                )
            splits[split], too_large = within_pixels(images, self.max_image_pixels)
            unreadable += too_large
            warn_unreadable_on_rank_zero(unreadable)
            if unreadable:
                rank_zero_warn(
                    f"{self.root / folder}: left out {len(unreadable)} unreadable files (named above)"
                )
        for line in left_out(manifest, self.root, layout, loose):
            rank_zero_warn(line)
        if self.evaluate_all and "val" not in splits:  # every image is evaluated, none held out
            splits["val"] = splits.get("test", splits.get("train"))
        if "train" in splits and not self.evaluate_all:
            check_every_class_readable(splits["train"], classes, self.root / layout["train"])
        if "val" not in splits:
            splits["train"], splits["val"] = hold_out(
                splits["train"], self.val_fraction, self.split_seed, self.split_by_path
            )
            untrained = np.setdiff1d(splits["val"].labels, splits["train"].labels)
            if len(untrained):
                rank_zero_warn(
                    f"data.val_fraction={self.val_fraction} held out every image of "
                    f"{', '.join(classes[label] for label in untrained)}: the model never trains on "
                    "them; give those classes more images, or a val/ folder"
                )
        for name, images in splits.items():
            if not len(images.labels):
                raise DataError(f"no readable images for the {name} split under {self.root}")
        if not self.evaluate_all:
            for line in unevaluated_classes(splits, classes):
                rank_zero_warn(line)
        rank_zero_info(classes_line(self.root, classes, splits))
        self.datasets = {
            name: ImageFolder(images, self.patch_size, hflip=self.hflip if name == "train" else 0.0)
            for name, images in splits.items()
        }
        if "test" not in self.datasets:
            if not self.evaluate_all and stage != "validate":  # eval.py split=val tests nothing
                rank_zero_info(
                    f"no test/<class>/ folders under {self.root}: the test split is the val split, which "
                    "also picks the best checkpoint; train/<class>/ beside test/<class>/ gives an "
                    "independent test/acc"
                )
            self.datasets["test"] = self.datasets["val"]
        self._refuse_other_images_on_other_ranks()

    def _setup_predict(self) -> None:
        """The predict_on files' dataset, numbered by their position in that list."""
        if "predict" in self.datasets:  # its headers read once, before the budget's check
            return
        numbered = [(path, number) for number, path in enumerate(self.predict_paths)]
        images, unreadable = images_of_files(numbered, workers=usable_cores())
        images, too_large = within_pixels(images, self.max_image_pixels)
        unreadable += too_large
        warn_unreadable_on_rank_zero(unreadable)
        if not len(images.labels):
            raise DataError(f"none of the {len(numbered)} input file(s) is a readable image (named above)")
        self.datasets["predict"] = ImageFolder(images, self.patch_size)

    def _refuse_other_images_on_other_ranks(self) -> None:
        """Each rank reads data.root itself: where the ranks' images differ (a copy on each
        node's disk, a folder that changed while they started), their epoch plans did too,
        and they trained some images twice and others never, without a word."""
        trainer = self.trainer
        if self._compared_across_ranks or trainer is None or trainer.world_size < 2:
            return
        if not torch.distributed.is_initialized():
            return  # ddp_spawn's launching process: its ranks compare what it sends them
        digest = b"".join(self.datasets[split].images.digest() for split in sorted(self.datasets)).hex()
        strategy = trainer.strategy
        if not strategy.reduce_boolean_decision(digest == strategy.broadcast(digest), all=True):
            raise DataError(  # on every rank, together
                f"the ranks found different images under data.root={self.root} (copies on each node "
                "that differ, or files that changed while the ranks started): give every rank the same images"
            )
        self._compared_across_ranks = True

    def _manifest(self) -> tuple[Manifest, dict[str, str]]:
        """root's manifest and which of its folders holds each split (split_layout)."""
        if self.shards:
            manifest = load_shards(self.root)
            return manifest, paths_layout(self.root, manifest.paths.tolist(), not self.evaluate_all)
        # Written by prepare_data; indexed here where this datamodule runs without a Trainer.
        path = manifest_path(self.root, self.index_dir)
        manifest = Manifest.load(path) or index_folder(self.root, self.index_dir)
        return manifest, folder_layout(self.root, need_train=not self.evaluate_all)

    @property
    def _devices_per_process(self) -> int:
        # Several under strategy=dp (PackedDataParallelStrategy), one process per device else.
        return getattr(self.trainer.strategy, "devices_per_process", 1) if self.trainer else 1

    def evaluate_at(self, budgets: Sequence[int] | None) -> None:
        """From now on evaluate with one loader per patch budget in `budgets`, each scaling the
        images to at most that many patches (None: one loader at data.max_patches), for
        accuracy across resolutions; rows are lengthened to hold one image where they must."""
        self.eval_budgets = tuple(budgets or (None,))

    def process_shape(self, split: str = "train", budget: int | None = None) -> PackedShape:
        """The shape of this process's batches of `split` (evaluated at patch `budget`): data.rows
        per device it drives (dp drives several and splits each batch by rows)."""
        shape = self.shape
        row_len = (
            shape.row_len if split == "train" else max(shape.row_len, self.policy(split, budget).max_patches)
        )
        return PackedShape(shape.rows * self._devices_per_process, row_len, shape.max_images)

    def batch_sampler(self, split: str, budget: int | None = None) -> PackedBatchSampler:
        """The sampler that plans `split`'s packed batches (evaluated at patch `budget`) for
        this rank."""
        trainer = self.trainer
        train = split == "train"
        # trainer.overfit_batches: the same first batches every epoch. Lightning turns a
        # loader's shuffling off by swapping its sampler, but ours shuffles inside the batch
        # sampler, where Lightning does not look (it sees a SequentialSampler, says nothing).
        overfit = bool(trainer and trainer.overfit_batches)
        return PackedBatchSampler(
            self.datasets[split].sizes,
            self.process_shape(split, budget),
            self.policy(split, budget),
            shuffle=train and not overfit,
            seed=self.seed,
            lookahead=self.lookahead,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )

    def _loader(self, split: str, budget: int | None = None) -> DataLoader:
        """`split`'s loader (evaluated at patch `budget`), the same one while the trainer, the
        batch shape and the image sizes are: Lightning asks for the loaders at every epoch
        (reload_dataloaders_every_n_epochs=1, so that it recounts the train batches, which vary
        by epoch), and a loader kept keeps its workers (persistent_workers) instead of starting
        new ones."""
        made_for = (self.trainer, self.process_shape(split, budget), self.policy(split, budget))
        kept = self._loaders.get(split)
        if kept is None or kept[0] != made_for:
            kept = self._loaders[split] = (made_for, self._new_loader(split, budget))
        return kept[1]

    def _eval_loaders(self, split: str) -> DataLoader | list[DataLoader]:
        """One loader per evaluation budget. Several are made anew for each evaluation, and
        their workers end with each loader's pass: a budget sweep runs once."""
        if len(self.eval_budgets) == 1:
            return self._loader(split, self.eval_budgets[0])
        return [self._new_loader(split, budget, keep_workers=False) for budget in self.eval_budgets]

    def teardown(self, stage: str) -> None:
        self._loaders.clear()  # their workers end with them

    def longest_side(self, split: str, budget: int | None = None) -> tuple[int, str]:
        """The most patches along a side of an image of `split` (set up) at patch `budget`, and
        that image's name; of the train split, at any budget its policy draws
        (data.min_patches..data.max_patches)."""
        images = self.datasets[split].images
        policy = self.policy(split, budget)
        budgets = range(policy.min_patches or policy.max_patches, policy.max_patches + 1)
        patches, index = longest_side(images.sizes[:, 0], images.sizes[:, 1], self.patch_size, budgets)
        return patches, images.name(index) if index >= 0 else ""

    def policy(self, split: str, budget: int | None = None) -> SizePolicy:
        """How big `split`'s images are: evaluation images at their native resolution, capped by
        patch `budget` (data.max_patches if None), every token kept."""
        if split == "train":
            return self.train_policy
        return SizePolicy(self.patch_size, budget or self.train_policy.max_patches)

    def _new_loader(self, split: str, budget: int | None = None, keep_workers: bool = True) -> DataLoader:
        workers = self._num_workers()
        context = loader_context(self.multiprocessing_context) if workers else None
        shape = self.process_shape(split, budget)
        options: dict[str, Any] = dict(
            batch_sampler=self.batch_sampler(split, budget),
            collate_fn=PackCollate(shape, self.patch_size**2 * 3),
            num_workers=workers,
            multiprocessing_context=context,
            worker_init_fn=partial(loader_worker_init, os.getpid()),
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=keep_workers and workers > 0,
        )
        if split == "train":
            return TrainLoader(
                self.datasets[split],
                batches_done=held_weakly(self._train_batches_done),
                epochs_ended=held_weakly(self._train_epochs_ended),
                **options,
            )
        return NamingLoader(self.datasets[split], **options)

    def _train_batches_done(self) -> int | None:
        """The batches of this epoch whose training step finished: Lightning's own count,
        the one its loops resume from; None once its epoch is over, which
        trainer.limit_train_batches ends before the plan's end (an epoch-end checkpoint read
        as a mid-epoch one: refused on other ranks or data, and its steps left miscounted)."""
        if not self.trainer:
            return 0
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return None if done >= self.trainer.num_training_batches else done

    def train_batches_per_rank(self) -> int:
        """The batches on each rank of the epoch to train next, at this run's settings: the
        training loader's length, but after a resume in an epoch whose batches were all done
        (PackedBatchSampler.resume), which keeps the checkpoint's."""
        return self.trainer.train_dataloader.batch_sampler.coming_length()

    def _train_epochs_ended(self) -> int:
        """The epochs the trainer has ended (their validation and epoch-end work run): the
        number of the epoch it plans next, which it sets the sampler's to."""
        return self.trainer.fit_loop.epoch_progress.current.processed if self.trainer else 0

    def _num_workers(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        # The cores this process may use, one left for its training loop; shared by the node's
        # ranks where Lightning or torchrun started them (they inherit one set of cores), not
        # where srun did (each task has its --cpus-per-task).
        local_processes = self.trainer.num_devices // self._devices_per_process if self.trainer else 1
        sharing = 1 if srun_tasks() > 1 else local_processes
        return max(1, min(8, usable_cores() // sharing - 1))

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train")
        if self.trainer:  # its length is the coming epoch's: Lightning reads it before set_epoch
            loader.batch_sampler.sampler.set_epoch(self.trainer.current_epoch)
        if self._train_position is not None:
            loader.load_state_dict(self._train_position)
            self._train_position = None
        if not self._reported:
            self._report_effective_batch(loader.batch_sampler)
            self._reported = True
        return loader

    # The training position is saved twice: in the loader's state, as Lightning asks, and
    # here. Lightning restores a loader's state only if the loader did not exist before the
    # checkpoint was read, but configure_optimizers builds it (estimated_stepping_batches,
    # Lightning issue 20550); a datamodule's state is restored before anything is built.
    def state_dict(self) -> dict[str, Any]:
        loader = self.trainer.train_dataloader if self.trainer else None
        return {"train_position": loader.state_dict()} if isinstance(loader, TrainLoader) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_position = state_dict.get("train_position")

    def step_tokens(self) -> int:
        """The tokens, padding included, of one optimizer step: the effective batch."""
        shape = self.process_shape()
        ranks, accumulation = step_factors(self.trainer)
        return ranks * accumulation * shape.rows * shape.row_len

    def _report_effective_batch(self, sampler: PackedBatchSampler) -> None:
        """Print and log what one optimizer step consumes: a token budget, not an image count."""
        stats = sampler.plan_stats()
        ranks, accumulation = step_factors(self.trainer)
        shape = self.process_shape()
        tokens = shape.rows * shape.row_len
        step_tokens = self.step_tokens()
        trainer = self.trainer
        limit = trainer.limit_train_batches if trainer else 1.0  # overfit_batches sets it too
        batches = limited(stats.batches, limit)
        knob = "overfit_batches" if trainer and trainer.overfit_batches else "limit_train_batches"
        # over the epoch's steps, the last window stepping however short it is: this rank's
        # images per batch would count its ranks' filler batches (no image) as full ones
        epoch_images = stats.epoch_images * batches / max(1, stats.batches)
        step_images = epoch_images / max(1, math.ceil(batches / accumulation))
        of_plan = "" if batches == stats.batches else f" of the {stats.batches} planned ({knob}={limit})"
        rank_zero_info(
            f"train: {batches} batches per epoch{of_plan} on each of {ranks} rank(s), each {shape.rows} "
            f"rows ({self.shape.rows} x {self._devices_per_process} device(s)) x {shape.row_len} tokens "
            f"holding {stats.images_per_batch:.1f} images on average ({stats.fill:.1%} real tokens); "
            f"one optimizer step = {ranks} rank(s) x {accumulation} accumulated x {tokens} tokens "
            f"= {step_tokens} tokens, ~{step_images:.0f} images"
        )
        # As metrics that the run's HParams session declares (train.py): hyperparameters
        # logged now, after the session was written, reached hparams.yaml only.
        figures = dict(zip(EFFECTIVE_BATCH_METRICS, (step_tokens, round(step_images, 1)), strict=True))
        for logger in self.trainer.loggers if self.trainer else []:
            logger.log_metrics(figures, step=self.trainer.global_step)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._eval_loaders("val")

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._eval_loaders("test")

    def predict_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._eval_loaders("predict")
