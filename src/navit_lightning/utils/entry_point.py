"""What the Hydra entry points (train.py, eval.py, predict.py) share besides instantiation."""

from __future__ import annotations

import difflib
import inspect
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, TextIO, TypeVar

import lightning as L
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from torch.multiprocessing.spawn import ProcessRaisedException

from navit_lightning import CONFIG_DIR, config_options, default_project_root
from navit_lightning.errors import ConfigError, DataError, OutputError
from navit_lightning.utils.checkpoints import LIGHTNING_CKPT_NAMES
from navit_lightning.utils.instantiate import absolute_path
from navit_lightning.utils.launch import in_sweep, quiet_rank_overrides
from navit_lightning.utils.shutdown import JobFailed, end_promptly_on_signals, job_end

T = TypeVar("T")
# the config groups the model instantiates with arguments of its own, and those arguments
BUILT_BY_THE_MODEL = {"optimizer": "its parameters", "scheduler": "the optimizer and the run's steps"}


def launch(hydra_main: Callable[[], Any]) -> None:
    """An entry point's main(): every rank ends promptly on a signal; under torchrun or SLURM,
    where every process runs Hydra itself, the .hydra folder and the log file are left to
    the first (see utils/launch.py)."""
    if not Path(CONFIG_DIR).is_dir():  # pip install . copies the package, not the checkout's configs
        sys.exit(
            f"error: the Hydra configs are not at {CONFIG_DIR}: navit-lightning runs from its "
            "checkout; install it with pip install -e . there"
        )
    default_project_root()
    end_promptly_on_signals()
    refuse_two_modes(sys.argv[1:])
    refuse_null_groups(sys.argv[1:])
    sys.argv += quiet_rank_overrides()
    hydra_main()


def refuse_two_modes(arguments: list[str]) -> None:
    """`-m ... --cfg job` ends in Hydra's ValueError traceback: refuse it in one line. Read as
    Hydra reads its flags (-mc job, --multi), and let --help through, which Hydra answers first."""
    args, _ = get_args_parser().parse_known_args(arguments)
    given = {
        "--run": args.run,
        "--multirun": args.multirun,
        "--cfg": args.cfg is not None,
        "--info": args.info is not None,
        "--shell-completion": args.shell_completion,
    }
    modes = [flag for flag, on in given.items() if on]
    if len(modes) > 1 and not (args.help or args.hydra_help):
        hint = (
            "; to print a sweep job's config, drop -m and give each swept setting one value"
            if args.multirun
            else ""
        )
        print(f"error: {' with '.join(modes)}: Hydra does one of them per command{hint}", file=sys.stderr)
        raise SystemExit(2)


def refuse_null_groups(arguments: list[str]) -> None:
    """`logger=null`, as lightning-hydra-template's configs write it, ends in Hydra's traceback
    on the command line: refuse it in one line that names the form Hydra takes, `~logger`."""
    for argument in arguments:
        group, _, value = argument.partition("=")
        group = group.lstrip("+")  # +logger=null: the same traceback
        if value != "null" or "/" in group:  # Hydra's own groups (hydra/launcher): options elsewhere
            continue
        options = config_options(group)
        if options:
            print(
                f"error: {argument}: Hydra cannot set a config group to null; ~{group} removes it, "
                f"or choose one of {options}",
                file=sys.stderr,
            )
            raise SystemExit(2)


def run_task(task: Callable[[DictConfig], T], cfg: DictConfig, from_checkpoint: bool = False) -> T:
    """An entry point's work on its composed config: Lightning's output tidied, bad input
    refused with one line. from_checkpoint: eval.py and predict.py, which load a training
    checkpoint without its training callbacks, and would be told to provide them."""
    tidy_lightning_output()
    if from_checkpoint:
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
    with refuse_bad_input():
        refuse_unread_settings(cfg)
        files_from_the_command_folder(cfg, from_checkpoint)
        return task(cfg)


def refuse_unread_settings(cfg: DictConfig) -> None:
    """`+ckpt_pth=last`, Hydra's own advice for a name its config lacks, added a setting that
    nothing reads, and the run went on without the one meant (here from scratch): a top-level
    setting added with + must be a config group."""
    if not HydraConfig.initialized():
        return
    for override in HydraConfig.get().overrides.task:
        key = override.partition("=")[0]
        name = key.lstrip("+")
        if key == name or "." in name or "/" in name or config_options(name.partition("@")[0]):
            continue
        close = difflib.get_close_matches(name, [str(setting) for setting in cfg if setting != name], n=1)
        meant = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"{override} adds a setting that nothing reads{meant}: --cfg job lists the command's settings"
        )


def files_from_the_command_folder(cfg: DictConfig, from_checkpoint: bool = False) -> None:
    """The files a command names (ckpt_path, init_from, predict.py's input) made absolute from
    the folder it ran in: under hydra.job.chdir=true, where the job runs in its run folder,
    a relative one was refused as missing (data.root is made absolute where it is built).
    An empty one is refused (`input=$UNSET` predicted every image under the working folder),
    and a null one that the command needs (a traceback of Path(None))."""
    for key in ("ckpt_path", "init_from", "input"):
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            continue
        needed = key == "input" or (key == "ckpt_path" and from_checkpoint)
        if cfg[key] is None and not needed:
            continue
        if cfg[key] is None or not str(cfg[key]).strip():
            given = "null" if cfg[key] is None else ""
            raise ConfigError(f"{key}={given} names no file: give {key}=<path>")
        if key == "ckpt_path" and cfg[key] in LIGHTNING_CKPT_NAMES:  # ckpt_path=last: Lightning's
            continue
        cfg[key] = absolute_path(cfg[key])


def log_config(config: DictConfig) -> None:
    rank_zero_info("Config:\n" + OmegaConf.to_yaml(config, resolve=True))


def tidy_lightning_output() -> None:
    """Lightning gives its loggers their own console handler at import time, before Hydra
    configures logging, and stops them propagating: hand their records to the root logger
    instead, so that they reach Hydra's console and the run's log file once. And drop what
    asks nothing of the user (quiet_lightning_warnings). The log file writes a file name
    that is not UTF-8 (os.fsdecode keeps its bytes as surrogates) escaped, as the console
    does: each such line failed there with a traceback of logging's, and the file lacked the
    warning that named the image."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.errors = "backslashreplace"
            if handler.stream is not None:  # opened already (not delay=True)
                handler.stream.reconfigure(errors="backslashreplace")
    quiet_lightning_warnings()
    warnings_into_the_log_file()


def quiet_lightning_warnings() -> None:
    """Drop what asks nothing of the user: a torch deprecation inside Lightning's own code, a
    warning about a hook that only the LightningModule defines (it warns whenever a
    datamodule is passed too), one about the prediction sampler's batches, one about loaders
    that the datamodule does not make, and an advert. Also for a notebook's train.build,
    whose logging is the notebook's own."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings(
        "ignore", message="You have overridden `on_before_batch_transfer` in `LightningModule`"
    )
    # At every prediction: PackedBatchSampler drops nothing, every image is in one of its batches
    warnings.filterwarnings("ignore", message="You are using a custom batch sampler")
    # On a GPU, at every fit, evaluation and prediction: its PyTorch issue is a new loader at
    # each epoch, whose persistent workers and pin-memory thread pile up; the datamodule hands
    # back the same loader while its settings last (PackedImageDataModule._loader).
    warnings.filterwarnings(
        "ignore", message=r"The combination of `DataLoader\(`pin_memory=True`, `persistent"
    )
    # A named function, not a lambda: addFilter skips a filter it already holds, so a sweep's
    # jobs and spawned ranks, each calling this, do not stack copies of it.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(drop_lightning_adverts)


def warnings_into_the_log_file() -> None:
    """Show a warning on the console as Python does, and write it into the run's log file too
    (train.log, eval.log): a skipped image, a budget left out or a setting overruled was
    missing there, where a finished run is read. Shown by Python's own showwarning, which
    writes to sys.stderr as it is at the time: Rich's live progress bar swaps it for a proxy
    that prints above the bar (a handler holding the real stderr wrote into the bar's line)."""
    shown = warnings.showwarning
    if getattr(shown, "func", None) is not show_and_log_warning:  # once: sweep jobs, ranks call this
        warnings.showwarning = partial(show_and_log_warning, shown)


def show_and_log_warning(
    show: Callable[..., None],
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`show` the warning, then write it to the root logger's log files, those of the job
    that runs now (in a sweep, each job's own)."""
    show(message, category, filename, lineno, file, line)
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
    record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def drop_lightning_adverts(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return "litlogger" not in message and "litmodels" not in message


@contextmanager
def refuse_bad_input() -> Iterator[None]:
    """Turn a DataError (bad data.root, a class folder without images, ...), a ConfigError (a
    GPU-only setting on CPU, ...) or Lightning's refusal of a Trainer argument (trainer.devices=0
    when built, trainer.val_check_interval past an epoch's batches when fit starts) into one
    line on the console and exit code 2, instead of a traceback; in a sweep (-m), into a failed
    job, where SystemExit would end the sweep at it."""
    try:
        yield
    except JobFailed:  # its line is logged
        raise
    except Exception as error:
        message = refusal(error)
        if message is not None:
            logging.getLogger("navit_lightning").error("error: %s", message)
            raise job_end(message, 2) from None
        # Hydra keeps a failed job's error to itself and, at the sweep's end, raises the first
        # failed job's alone: the others' would be nowhere, in the console or the job's log.
        if in_sweep():
            logging.getLogger("navit_lightning").exception("error: this job failed")
        raise


def refusal(error: Exception) -> str | None:
    """What `error` says to the user, or None where it is not about the input."""
    if isinstance(error, (DataError, ConfigError, OutputError)):
        return str(error)
    if isinstance(error.__context__, OutputError):  # a logger's flush failed on the same full disk
        return str(error.__context__)
    if isinstance(error, ProcessRaisedException):  # a ddp_spawn rank's, as strategies/ddp.py sends it
        last_line = error.msg.strip().rsplit("\n", 1)[-1]
        sent_as = f"{ConfigError.__module__}.{ConfigError.__qualname__}: "
        return last_line.removeprefix(sent_as) if last_line.startswith(sent_as) else None
    if not isinstance(error, InstantiationException):
        return trainer_setting_refused(error)
    # Hydra wraps what a constructor raises: the cause is what counts.
    cause = error.__cause__
    if isinstance(cause, (DataError, ConfigError)):
        return str(cause)
    key = re.search(r"^full_key: (\S+)", str(error), re.MULTILINE)
    if key is None:
        return None
    # Hydra's own, for a _target_ it could not import (not a constructor's ImportError)
    unlocated = re.match(r"Error locating target '([^']*)'", str(error))
    if unlocated and isinstance(cause, ImportError):
        why = "; ".join(str(cause).splitlines()[1:])
        return f"{key[1]}._target_={unlocated[1]} cannot be imported: {why}"
    group = key[1].rsplit(".", 1)[-1]
    if group in BUILT_BY_THE_MODEL and isinstance(cause, TypeError) and "required positional" in str(cause):
        return (
            f"{key[1]}: {cause}: add `_partial_: true` to its config, the model passes "
            f"{BUILT_BY_THE_MODEL[group]} when it builds it"
        )
    # Lightning's refusals of arguments (a callback's too), a keyword no constructor takes
    # (+data.rowz=3), and whatever the Trainer's constructor raises: it only checks them.
    trainer = key[1].split(".")[0] == "trainer"
    if (
        isinstance(cause, MisconfigurationException)
        or (isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause))
        or (trainer and isinstance(cause, (TypeError, ValueError)))
    ):
        return f"{key[1]}: {cause}"
    return None


def trainer_setting_refused(error: Exception) -> str | None:
    """Lightning's refusal of a Trainer argument that it checks only when a fit starts, against
    the data (`val_check_interval` past the batches of an epoch, a `limit_val_batches`
    fraction of less than a batch): raised in Lightning's own code, its message naming the
    argument."""
    if not isinstance(error, (ValueError, MisconfigurationException)) or error.__traceback__ is None:
        return None
    innermost = error.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    if not innermost.tb_frame.f_globals.get("__name__", "").startswith("lightning."):
        return None
    arguments = inspect.signature(L.Trainer.__init__).parameters
    # `max_epochs`, or Trainer(max_epochs=1) (a resume whose checkpoint is past it)
    names = re.findall(r"`(\w+)`|Trainer\((\w+)=", str(error))
    named = next((name for name in chain.from_iterable(names) if name in arguments), None)
    return None if named is None else f"trainer.{named}: {str(error).strip()}"
