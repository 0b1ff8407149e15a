"""Checkpoints a run can resume from: written atomically, periodically, and checked before
a run starts from one."""

from __future__ import annotations

import logging
import os
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from navit_lightning.errors import ConfigError, OutputError, free_space, space_advice
from navit_lightning.utils.instantiate import dotted_settings
from navit_lightning.utils.launch import resume_overrides
from navit_lightning.utils.shutdown import is_explained_elsewhere

log = logging.getLogger(__name__)

# What Lightning's own ckpt_path accepts besides a file.
LIGHTNING_CKPT_NAMES = {"last", "best", "hpc", "registry"}
# Where a training run leaves the checkpoint to name, as messages show it.
CKPT_PATH_EXAMPLE = "logs/train/runs/<run>/checkpoints/last.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint next to its destination and renames it into place. Lightning's
    own save goes through a temporary file in the system's temp folder and moves it: across
    file systems (a node's /tmp, the cluster's shared disk) that move is a copy, and a kill
    during it leaves a truncated checkpoint where the good one was."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, partial)
            # on the disk before the rename, and the rename too: a node that loses power may
            # otherwise come back with the new name on a short file
            with open(partial, "rb") as written:
                os.fsync(written.fileno())
            os.replace(partial, path)  # atomic within one file system
            sync_folder(path.parent)
        except (OSError, RuntimeError) as error:
            # torch's writer raises a RuntimeError with no errno ("unexpected pos ..." on a full disk)
            why = (
                getattr(error, "strerror", None) or f"{str(error).rsplit('] . ', 1)[-1]}; {free_space(path)}"
            )
            raise OutputError(
                f"checkpoint {path} cannot be written ({why}): {space_advice(error)}resume in a "
                f"writable hydra.run.dir; the {path.name} saved before, if any, is whole"
            ) from None
        finally:
            with suppress(OSError):  # its folder may be what failed
                partial.unlink(missing_ok=True)


def sync_folder(folder: Path) -> None:
    """Its entries on the disk; some file systems take no fsync of a folder (their renames are
    durable, or never will be): nothing to do there."""
    with suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, whose file names take a version (-v1) only against the
    checkpoints it keeps: a resume from a last.ckpt saved before a best checkpoint writes that
    one again under its own name, where Lightning wrote a -v1 beside the stopped run's stale
    file (and the run took the -v1 for its best); two validations of one epoch under
    save_top_k>1 still keep two files (without a version the second overwrote the first,
    which top-k then deleted: the best checkpoint lost)."""

    resuming = False  # set for a fit that resumes a checkpoint (the trainer knows only later)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning then saves at training steps alone, each scored with the last validation's
        # value: the "best" held other weights than the ones validated, and train.py tested it
        timed = {
            "every_n_train_steps": self._every_n_train_steps,
            "train_time_interval": self._train_time_interval,
        }
        if self.monitor is not None and (given := [key for key, value in timed.items() if value]):
            raise ConfigError(
                f"callbacks.model_checkpoint.{given[0]} saves between validations, scored with the last "
                f"one's {self.monitor}: leave it out (the best is saved after validations; "
                f"callbacks.resume_checkpoint.{given[0]} times last.ckpt)"
            )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning warns of a folder holding checkpoints, as a resume's own always does
        with warnings.catch_warnings():
            if self.resuming:
                warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def _get_metric_interpolated_filepath_name(
        self, monitor_candidates: dict[str, torch.Tensor], trainer: L.Trainer, del_filepath: str | None = None
    ) -> str:
        filepath = self.format_checkpoint_name(monitor_candidates)
        version = self.STARTING_VERSION
        while filepath in self.best_k_models and filepath != del_filepath:
            filepath = self.format_checkpoint_name(monitor_candidates, ver=version)
            version += 1
        return filepath


class ResumeCheckpoint(ModelCheckpoint):
    """`last.ckpt`, for resuming: every `every_n_train_steps` steps or `train_time_interval`
    (not both, Lightning's rule), at the end of every training epoch, and when fit stops on
    an exception or a signal. It monitors nothing, so unlike a ModelCheckpoint with a monitor
    it never waits for the first validation (a crash in a long first epoch loses nothing)."""

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int | None = None,
        train_time_interval: float | None = None,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=timedelta(seconds=train_time_interval) if train_time_interval else None,
            save_on_exception=True,
            enable_version_counter=False,  # a resumed run overwrites last.ckpt, not last-v1.ckpt
        )
        self.trained_here = False  # whether this process has run a training batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.trained_here = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Saves wait for the end of an optimizer step's batches: the gradients accumulated in
        # a window so far are not in a checkpoint, so a resume from inside it would step on the
        # window's later batches alone. Every rank sees the same batch_idx: its collectives pair.
        if batches_stepped(trainer) == trainer.fit_loop.epoch_loop.batch_progress.current.processed:
            with (
                saved_as_before_validation(trainer) as before_validation,
                saved_as_epoch_end(trainer) as ending,
            ):
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if (before_validation or ending) and self._last_global_step_saved == trainer.global_step:
                # a save at an epoch's or the fit's end after this batch is not skipped as
                # made at this step: a run ended there kept the before-validation form, and
                # every resume of it ran that validation again; the epoch's end has work of
                # its own (its metrics, the callbacks' epoch ends)
                self._last_global_step_saved = -1

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the epoch's validation: resuming from here starts the next epoch
        if self._should_skip_saving_checkpoint(trainer):
            return
        with saved_as_within_epoch(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's saves last.ckpt here where no save came at the last step: also under
        # trainer.fast_dev_run (debug=fdr), which writes nothing. Not where this process
        # trained nothing (an early-stopped run resumed stays stopped): the loop had moved to
        # the next epoch, which a later resume skipped, and WeightAveraging had put the
        # average into the model, which replaced the trained weights.
        if self.trained_here and not self._should_skip_saving_checkpoint(trainer):
            super().on_train_end(trainer, pl_module)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        # A save that failed would fail again. Before this process's first batch the state on
        # disk is the latest, and a stop while restoring it (trainer.max_epochs below the
        # checkpoint's epoch) wrote it back without its optimizer and schedule states. After
        # the fit (train.py's budget sweep validates the best checkpoint) a stop wrote the best
        # weights into last.ckpt at the fit's last step: ckpt_path=last went on from them.
        fitting = trainer.state.fn == TrainerFn.FITTING
        if isinstance(exception, OutputError) or not self.trained_here or not fitting:
            return
        # Saving enters a barrier that every rank must reach. Across ranks only a stop they
        # all make at once (SIGTERM, through StopTogetherOnSigterm; Ctrl-C) reaches it; an
        # error is one rank's (one GPU out of memory), or a broken process group's: that
        # rank waited in the barrier for collective_timeout_s, then exited with the
        # barrier's error in place of its own. Before the first step there is nothing to lose.
        if trainer.world_size > 1 and isinstance(exception, Exception):
            if trainer.global_step > 0 and not is_explained_elsewhere(exception):
                log.warning(
                    f"rank {trainer.global_rank}: {type(exception).__name__} at step "
                    f"{trainer.global_step}, not saved (every rank would have to join the save): "
                    f"{resume_overrides()} resumes from the last periodic or epoch save"
                )
            return
        # last.ckpt only: ModelCheckpoint would also write a step-named copy. Also where a save
        # at this step came before the validation that stopped: its resume would skip it.
        if self._should_save_on_exception(trainer) or (
            in_fit_validation(trainer) and not trainer.fast_dev_run
        ):
            rewind_to_last_step(trainer)
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        # also where it was saved at this step already (an epoch's end, then a signal); at step 0
        # nothing was (a resume refused at its start has last_model_path restored, and
        # _last_global_step_saved is 0 until a save)
        if self.last_model_path and self._last_global_step_saved == trainer.global_step > 0:
            rank_zero_info(
                f"stopped at step {trainer.global_step} ({type(exception).__name__}): saved "
                f"{self.last_model_path}, which {resume_overrides()} resumes from"
            )


@contextmanager
def saved_as_within_epoch(trainer: L.Trainer) -> Iterator[None]:
    """An epoch cut short (trainer.max_steps, an early stop at a validation within it) is
    saved as a stop within it, which a resume goes on from: Lightning counted it as over, and
    the resume trained its rest as the next epoch, one epoch short of the run. Where a
    validation was due at the stop, in the form of a save at that validation's end, whose
    resume counts the step for the loggers (they logged every later step one too high). Due
    as the resume decides it (validation_due_on_resume)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_progress = trainer.fit_loop.epoch_progress
    progress = epoch_loop.batch_progress
    cut_short = int(not progress.is_last_batch and progress.current.processed < trainer.num_training_batches)
    validated = cut_short and validation_due_on_resume(trainer)
    epoch_progress.current.processed -= cut_short
    epoch_progress.total.processed -= cut_short
    epoch_loop._batches_that_stepped -= validated
    try:
        yield
    finally:
        epoch_progress.current.processed += cut_short
        epoch_progress.total.processed += cut_short
        epoch_loop._batches_that_stepped += validated


@contextmanager
def saved_as_before_validation(trainer: L.Trainer) -> Iterator[bool]:
    """A save in a batch's on_train_batch_end whose validation is due, in the form of a stop
    at that validation's start (the batch ended, the validation's first batch begun), which a
    resume runs: Lightning's resume completed the batch and skipped the validation (a kill
    during it lost its metrics and its best checkpoint). Lightning runs the checkpoint
    callbacks' on_train_batch_end after the other callbacks', so the form holds every batch
    end's work (an EMA update). Yields whether it applies. Not to a timed validation
    (trainer.val_check_interval as a time): the resume starts its clock anew and skips it,
    and read the form as a skipped stop inside it (every later step logged one too low)."""
    if trainer._val_check_time_interval is not None or not validation_due_on_resume(trainer):
        yield False
        return
    epoch_loop = trainer.fit_loop.epoch_loop
    progresses = (epoch_loop.batch_progress, epoch_loop.val_loop.batch_progress)
    before = [progress.state_dict() for progress in progresses]
    epoch_loop.batch_progress.increment_completed()
    validate_again(epoch_loop.val_loop, started=False)
    try:
        yield True
    finally:
        for progress, state in zip(progresses, before, strict=True):
            progress.load_state_dict(state)


@contextmanager
def saved_as_epoch_end(trainer: L.Trainer) -> Iterator[bool]:
    """A save at the end of an epoch's last batch, no validation due, in the form of a save
    at the epoch's end (ResumeCheckpoint.on_train_epoch_end's), which a resume goes on from
    with the next epoch. Lightning's resume of the batch-end form counts the epoch as over
    and skips as many batches of the next one as it had, where the two epochs' batch counts
    differ (2 of 32 trained, then the run ended), and left its epoch count one short (a
    later resume trained one batch). Yields whether it applies."""
    if not ends_epoch_unvalidated(trainer):
        yield False
        return
    epoch_loop, epoch_progress = trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_progress
    before = epoch_loop.batch_progress.state_dict(), epoch_progress.state_dict()
    as_epoch_end(trainer)
    try:
        yield True
    finally:
        epoch_loop.batch_progress.load_state_dict(before[0])
        epoch_progress.load_state_dict(before[1])
        epoch_loop._batches_that_stepped -= 1


def ends_epoch_unvalidated(trainer: L.Trainer) -> bool:
    """Whether the current batch is its epoch's last, with no validation due after it."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    last = progress.is_last_batch or progress.current.processed >= trainer.num_training_batches
    return last and not validation_due_on_resume(trainer)


def as_epoch_end(trainer: L.Trainer) -> None:
    """From the end of an epoch's last batch (in its on_train_batch_end) to the epoch's end:
    the batch completed and counted as stepped (Lightning does both after the hook), the
    epoch processed."""
    epoch_loop = trainer.fit_loop.epoch_loop
    for tracker in (epoch_loop.batch_progress.current, epoch_loop.batch_progress.total):
        tracker.completed = tracker.processed
    epoch_loop._batches_that_stepped += 1
    trainer.fit_loop.epoch_progress.increment_processed()


def resume_epoch_ends_as_ended(trainer: L.Trainer) -> None:
    """Given trainer.max_steps, Lightning's fit loop resumes a checkpoint of an epoch's end as
    an epoch still running (Lightning issue 19617): it ran that epoch again with no batch
    left and counted it, so the resumed run trained one epoch less, and none where its
    first run had ended at an epoch's end (max_steps there, or max_epochs then raised). It
    resumes as without max_steps: the next epoch starts. Lightning's reason to differ, an
    epoch that max_steps cut short, is saved as a stop within it (saved_as_within_epoch)."""
    trainer.fit_loop._iteration_based_training = _resumed_by_epochs


def _resumed_by_epochs() -> bool:
    # a module's function, not a lambda: ddp_spawn pickles the trainer for its ranks
    return False


def batches_stepped(trainer: L.Trainer) -> int:
    """This epoch's batches up to its last optimizer step: those processed, less the ones
    of an accumulation window still open (the epoch's last window steps however short)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if done >= trainer.num_training_batches:
        return done
    return done - done % trainer.accumulate_grad_batches


def in_fit_validation(trainer: L.Trainer) -> bool:
    """Whether fit is running one of its validations (not the sanity check)."""
    return trainer.validating and not trainer.sanity_checking


def rewind_to_last_step(trainer: L.Trainer) -> None:
    """Counts this epoch's batches after its last optimizer step as never fetched, before a
    save on a stop: a batch fetched and not finished (a stop at its start or in its step), and
    an open accumulation window's batches, whose gradients no checkpoint holds. Lightning's
    resume would count them as done: it would skip them, and log every later step one too
    far. The weights have not moved since that step, so the resume replays them exactly.
    A stop after that step and before its batch's end (in its on_train_batch_end, or in the
    validation due after it) leaves that end to the resume: it runs the validation again from
    its first batch (the metrics of one cut short are in no checkpoint; Lightning's resume
    took it as done, and tested an older best checkpoint), then counts the step for the
    loggers, as the batch's end would have (they logged every later step one too low; after
    an epoch's last batch, the resume trained one more)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress
    stepped = batches_stepped(trainer)
    in_validation = in_fit_validation(trainer)
    end_pending = stepped == progress.current.processed and (
        in_validation or progress.current.completed < stepped
    )
    for field in ("ready", "started", "processed", "completed"):
        surplus = getattr(progress.current, field) - stepped
        setattr(progress.current, field, stepped)
        setattr(progress.total, field, getattr(progress.total, field) - surplus)
    if stepped < trainer.num_training_batches:
        progress.is_last_batch = False
    validation_due = validation_due_on_resume(trainer)
    if not end_pending:
        if validation_due and 0 < stepped < trainer.num_training_batches:
            # the last step's validation has run (a stop signalled in it comes at the next
            # step): Lightning's resume takes the save for one at that validation's end and
            # counts the step for the loggers again (every later step logged one too far)
            epoch_loop._batches_that_stepped -= 1
        return
    if in_validation or validation_due:
        validate_again(epoch_loop.val_loop, in_validation)
    elif ends_epoch_unvalidated(trainer):  # see saved_as_epoch_end
        as_epoch_end(trainer)
    else:  # the form of a save in on_train_batch_end, whose end Lightning's resume completes
        progress.current.completed -= 1
        progress.total.completed -= 1


def validation_due_on_resume(trainer: L.Trainer) -> bool:
    """Whether fit's validation is due after the current batch, as a resume decides it:
    without the stop's request (Lightning validates at any trainer.should_stop, as at
    trainer.max_time's; its resume does not)."""
    stopping, trainer.should_stop = trainer.should_stop, False
    try:
        return trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    finally:
        trainer.should_stop = stopping


def validate_again(val_loop: Any, started: bool) -> None:
    """Sets fit's validation loop to what Lightning reads as a stop inside the first batch of
    a validation (RESTARTED_MID_EVALUATION), which a resume runs from there: dropping the
    batches of this one, if it has `started`."""
    progress = val_loop.batch_progress
    before = progress.total.completed - (progress.current.completed if started else 0)
    for tracker, base in ((progress.total, before), (progress.current, 0)):
        tracker.ready = tracker.started = base + 1
        tracker.processed = tracker.completed = base


def read_checkpoint(
    ckpt_path: str | Path | IO[bytes], key: str = "ckpt_path", map_location: Any = "cpu"
) -> dict[str, Any]:
    """A whole checkpoint of this project's train.py (memory-mapped), or a ConfigError whose
    one line names the fix: missing, truncated (a kill during a copy), or another program's.
    `key`: the setting that named the file, as the line shows it; `map_location`: torch.load's.
    A file object is read as it is."""
    if not isinstance(ckpt_path, str | os.PathLike):
        return ours(torch.load(ckpt_path, map_location=map_location, weights_only=True), key, ckpt_path)
    path = Path(ckpt_path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"{key}={path} {what}: pass a run's checkpoint file, e.g. {CKPT_PATH_EXAMPLE}"
            + (" (train.py also takes ckpt_path=last)" if key == "ckpt_path" else "")
        )
    try:
        with open(path, "rb") as file:
            start = file.read(4)
    except OSError as error:
        raise ConfigError(f"{key}={path} cannot be read ({error.strerror}): check its permissions") from None
    if len(start) < 4:
        raise ConfigError(f"{key}={path} is empty or truncated: use another checkpoint")
    if start != b"PK\x03\x04":  # a truncated one starts as torch.save wrote it
        raise ConfigError(
            f"{key}={path} is not a checkpoint (not the zip archive torch.save writes): pass one "
            "from logs/<task>/runs/<run>/checkpoints/"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            broken = archive.testzip()
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except Exception as error:  # torch and zipfile raise many kinds for a damaged file
        raise ConfigError(f"{key}={path} cannot be read ({error}): it is truncated or damaged") from None
    if broken is not None:
        raise ConfigError(f"{key}={path} is damaged ({broken} fails its check): use another checkpoint")
    return ours(checkpoint, key, path)


def ours(checkpoint: Any, key: str, source: Any) -> dict[str, Any]:
    """`checkpoint`, read from `source`, if train.py wrote it."""
    if not isinstance(checkpoint, dict) or not {"state_dict", "run_config"} <= checkpoint.keys():
        raise ConfigError(
            f"{key}={source} is not a checkpoint of navit_lightning's train.py (no state_dict and "
            "run_config): pass one from logs/<task>/runs/<run>/checkpoints/"
        )
    return checkpoint


def load_training_run(ckpt_path: str | Path) -> tuple[DictConfig, list[str] | None]:
    """The training config a checkpoint stores, and its class names in label order (None for
    a checkpoint saved before they were stored)."""
    checkpoint = read_checkpoint(ckpt_path)
    return OmegaConf.create(checkpoint["run_config"]), run_class_names(checkpoint)


def run_class_names(checkpoint: dict[str, Any]) -> list[str] | None:
    """A checkpoint's class names in label order; None where it predates them and stores
    their number alone (run_config.model.num_classes)."""
    names = checkpoint.get("class_names")
    return list(names) if names else None


def numbered_classes(num_classes: int) -> list[str]:
    """The class names of a checkpoint saved before they were stored: its labels' numbers."""
    return [str(label) for label in range(num_classes)]


def check_resumable(
    model: torch.nn.Module,
    model_config: DictConfig,
    ckpt_path: str | Path,
    averaging: bool,
    class_names: list[str],
    fitting: bool = True,
    seed: int | None = None,
) -> dict[str, Any]:
    """The checkpoint at `ckpt_path` (memory-mapped), once it is one to resume (`fitting`;
    train=false tests it).
    Refused here with one line, before launch: a checkpoint of another network (Lightning
    would fail in every rank on a page of size mismatches), of other classes (`class_names`:
    the data's; a renamed class folder would shift the labels without a word), and one
    written with callbacks=ema resumed without an averaging callback (Lightning would carry
    on from the average, which the checkpoint holds as its weights, and drop the trained
    weights saved beside it), one of weights alone (save_weights_only) for a fit, which
    failed mid-start with a traceback, after writing a last.ckpt of its own, and a fit at
    another optimizer.lr (the rates and schedule resume as saved: the run would train at the
    checkpoint's rate while its config and logged settings named the command's), and a fit
    with another `seed` (a sweep resumed with its values in another order took up other jobs'
    folders: seed=0 went on from seed 1's checkpoint, recorded as seed 0's run)."""
    checkpoint = read_checkpoint(ckpt_path)
    saved_seed = checkpoint["run_config"].get("seed")
    if fitting and seed is not None and saved_seed not in (None, seed):
        raise ConfigError(
            f"ckpt_path={ckpt_path} was trained with seed={saved_seed}, not {seed}: a resumed run goes on "
            f"in its checkpoint's data order; resume with seed={saved_seed} (a sweep: with its values in "
            "the order its first command gave them), or start a fit from its weights with "
            f"init_from={ckpt_path}"
        )
    if fitting and "optimizer_states" not in checkpoint:
        raise ConfigError(
            f"ckpt_path={ckpt_path} holds weights alone (no optimizer or loop state to resume): "
            f"start a fit from them with init_from={ckpt_path} instead"
        )
    saved_lr = (checkpoint["run_config"]["model"].get("optimizer") or {}).get("lr")
    lr = OmegaConf.select(model_config, "optimizer.lr")
    if fitting and saved_lr != lr:
        raise ConfigError(
            f"ckpt_path={ckpt_path} trained at optimizer.lr={saved_lr}, not {lr}: a resumed run keeps "
            f"its checkpoint's rate and schedule; resume with optimizer.lr={saved_lr}, or start a fit "
            f"from its weights with init_from={ckpt_path}"
        )
    # first: a class folder added or removed changes the head, which read as another network
    num_classes = checkpoint["run_config"]["model"]["num_classes"]
    check_same_classes(class_names, run_class_names(checkpoint), num_classes, ckpt_path)
    changes = setting_changes(checkpoint, model_config, "model.")
    network_changed = any(change.startswith("model.net.") for change in changes)
    if network_changed or tensor_shapes(checkpoint["state_dict"]) != tensor_shapes(model.state_dict()):
        raise ConfigError(
            f"ckpt_path={ckpt_path} holds another network ({'; '.join(changes) or 'other tensors'}): "
            f"resume with the settings it was trained with{as_given(changes)}, or leave ckpt_path out to "
            "start afresh"
        )
    # a test (train=false) takes a callbacks=ema checkpoint's weights, its average, as eval.py does
    if fitting and "current_model_state" in checkpoint and not averaging:
        raise ConfigError(
            f"ckpt_path={ckpt_path} was written with callbacks=ema (its weights are the average): "
            "resume with callbacks=ema, which carries on from the trained weights saved beside it"
        )
    # Lightning restores the schedule's step and rates; its function, and so these, the command's
    schedule = changed_settings(checkpoint, model_config, "model.scheduler", ignored=())
    if fitting and schedule:
        changes = ", ".join(f"{key.removeprefix('model.')} {was} -> {now}" for key, was, now in schedule)
        rank_zero_info(f"resumed with this command's schedule settings: {changes}")
    return checkpoint


def load_initial_weights(
    model: torch.nn.Module, model_config: DictConfig, init_from: str | Path, class_names: list[str]
) -> None:
    """Fine-tuning: `model`'s network (model.net) takes the weights of another run's
    checkpoint, and its head too where that run had the same head over the same classes;
    otherwise the head stays newly initialised. The optimizer, schedule and step start afresh
    (ckpt_path resumes them). A network of other shapes is refused, naming the settings."""
    checkpoint = read_checkpoint(init_from, key="init_from")
    saved = checkpoint["state_dict"]
    parts = {name: part_state(saved, name) for name in ("net", "head")}
    network_changes = setting_changes(checkpoint, model_config, "model.net.")
    if network_changes or tensor_shapes(parts["net"]) != tensor_shapes(model.net.state_dict()):
        raise ConfigError(
            f"init_from={init_from} holds another network ({'; '.join(network_changes) or 'other tensors'}): "
            f"start with the model.net settings it was trained with{as_given(network_changes)}"
        )
    model.net.load_state_dict(parts["net"])
    same_head = tensor_shapes(parts["head"]) == tensor_shapes(model.head.state_dict())
    if same_head and checkpoint.get("class_names") == class_names:
        model.head.load_state_dict(parts["head"])
        loaded = "its network and head (the same classes)"
    else:
        loaded = f"its network, with a new head for this data's {len(class_names)} classes"
    rank_zero_info(f"init_from={init_from}: loaded {loaded}; the optimizer, schedule and step start afresh")


def part_state(state: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The entries of a submodule (`net`) in a LightningModule's state_dict, named as in the
    submodule's own."""
    prefix = f"{part}."
    return {name.removeprefix(prefix): tensor for name, tensor in state.items() if name.startswith(prefix)}


def tensor_shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


# model.* settings that leave what the network computes as it was: how it trains, and how
# it runs (model.net.fractional_pos, for one, keeps every tensor's shape and not its meaning)
NOT_THE_NETWORK = (
    "model.optimizer",
    "model.scheduler",
    "model.lr_",
    "model.compile",
    "model.net.attention",
    "model.net.grad_checkpointing",
)


def changed_settings(
    checkpoint: dict[str, Any],
    model_config: DictConfig,
    within: str,
    ignored: tuple[str, ...] = NOT_THE_NETWORK,
) -> list[tuple[str, Any, Any]]:
    """[('model.net.dim', 32, 64), ...]: the settings under `within` (but those `ignored`) in
    which a checkpoint's run (the first value) and this one (the second) differ."""
    saved = dotted_settings(checkpoint["run_config"].get("model", {}), "model.")
    now = dotted_settings(OmegaConf.to_container(model_config, resolve=True), "model.")
    return [
        (key, saved.get(key), now.get(key))
        for key in sorted(saved.keys() | now.keys())
        if key.startswith(within) and not key.startswith(ignored) and saved.get(key) != now.get(key)
    ]


def setting_changes(checkpoint: dict[str, Any], model_config: DictConfig, within: str) -> list[str]:
    """['model.net.dim=32 there, 64 here', ...]: changed_settings, as a refusal names them."""
    return [
        f"{key}={was} there, {now} here"
        for key, was, now in changed_settings(checkpoint, model_config, within)
    ]


def as_given(changes: list[str]) -> str:
    """The checkpoint's side of setting_changes as overrides to add: a setting that follows
    another (model.net.max_grid: data.max_patches) was never given, nor known to be the cause."""
    return f" ({' '.join(change.split(' there, ')[0] for change in changes)})" if changes else ""


def check_same_classes(
    data_names: list[str], run_names: list[str] | None, num_classes: int, ckpt_path: str | Path
) -> None:
    """Labels are positions among the class folders: data with other classes would be scored
    against the wrong ones. A checkpoint saved before the names were (run_names None) is
    checked by their number: its folders are numbered 0, 1, ... here. Folders the user named
    0, 1, ... are names like any others (1..10 against 0..9 shifts every label)."""
    if data_names == run_names or (run_names is None and len(data_names) == num_classes):
        return
    run_names = run_names or numbered_classes(num_classes)
    differences = [
        f"{len(names)} {what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for what, names in (
            ("not trained on", sorted(set(data_names) - set(run_names))),
            ("missing", sorted(set(run_names) - set(data_names))),
        )
        if names
    ]
    raise ConfigError(
        f"the data's classes are not those ckpt_path={ckpt_path} was trained on "
        f"({'; '.join(differences)}): use data with the same class folders"
    )
