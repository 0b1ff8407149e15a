"""A multi-process run ends, with one line that says why, instead of hanging.

Two ways a run used to hang for good:
- A rank waits in a collective that another rank never enters. torch's process-group timeout
  (`trainer.strategy.collective_timeout_s`, configs/strategy/ddp.yaml) turns that wait into an
  error; `explain_collective_failure` turns the error into one line naming the rank and the
  hook, and exit code 3 (in a sweep, a failed job). Ranks that do not all join in
  `trainer.strategy.startup_timeout_s` end the same way, with a line that says so.
- A signal is ignored. Python runs a signal handler only between bytecodes of the main
  thread, so a rank blocked in a collective never runs Lightning's SIGTERM handler (which
  forwards the signal to the other ranks), and the parent of ddp_spawn ranks died without
  them. `end_promptly_on_signals` gives each process a watchdog thread, woken through
  `signal.set_wakeup_fd`: after SIGTERM or SIGINT it leaves the main thread `grace_s` seconds
  to stop on its own (Lightning's graceful path), from the signal or from the last batch
  that ended since (`note_progress`), then kills the process's descendants (ranks, loader
  workers) and exits.

And a SIGTERM during training stops every rank before the same training step, where
`last.ckpt` is written (`StopTogetherOnSigterm`); one after the fit's last training step
ends the fit there, without its test.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch.distributed
from hydra.errors import CompactHydraException
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from navit_lightning.utils.launch import in_sweep, resume_overrides

log = logging.getLogger("navit_lightning")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 5.0
_watchdog: threading.Thread | None = None
_progress_at = -math.inf  # time.monotonic() when a batch last ended (note_progress)


def end_promptly_on_signals(grace_s: float = GRACE_S) -> None:
    """Install the watchdog once per process (a no-op off the main thread or if installed)."""
    global _watchdog
    if _watchdog is not None or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # Python writes to the wakeup fd only for signals it handles: SIGINT has its handler
    # (KeyboardInterrupt); SIGTERM gets one that exits as a clean SystemExit.
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _exit_on_signal)
    # A forked loader worker inherits the wakeup fd: its signals must not wake this watchdog.
    os.register_at_fork(after_in_child=_forget_in_child)
    _watchdog = threading.Thread(target=_watch, args=(read_fd, grace_s), name="signal-watchdog", daemon=True)
    _watchdog.start()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _forget_in_child() -> None:
    global _watchdog
    _watchdog = None
    with suppress(ValueError):  # a child forked off another thread than the main one
        signal.set_wakeup_fd(-1)


def note_progress() -> None:
    """A batch ended. After a stop signal the process goes on to where it can stop (the next
    optimizer step, through a validation or the rest of an accumulation window): the
    watchdog's grace runs from the last such batch, not from the signal, which killed runs
    in a validation longer than the grace unsaved."""
    global _progress_at
    _progress_at = time.monotonic()


def _watch(read_fd: int, grace_s: float) -> None:
    while (signum := os.read(read_fd, 1)[0]) not in STOP_SIGNALS:
        pass
    signalled_at = time.monotonic()
    while (idle := time.monotonic() - max(signalled_at, _progress_at)) < grace_s:
        time.sleep(grace_s - idle)
    # Still here: the main thread is stuck (a collective, a join on stuck children).
    name = signal.Signals(signum).name
    log.error(
        f"error: {name} not handled within {grace_s:.0f} s (no batch ended): "
        "stopping this process and its children"
    )
    for pid in descendants(os.getpid()):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(128 + signum)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class StopTogetherOnSigterm(L.Callback):
    """A SIGTERM to any rank during fit stops every rank before the same training step:
    there ResumeCheckpoint writes last.ckpt, and each process exits with code 143.

    Lightning's own handling (2.6) races under ddp (Lightning issue 20806): its handler
    broadcasts from inside the signal handler, and each rank also stops at the end of a step
    on its own flag. Ranks signalled at different moments (srun, torchrun and a scheduler's
    cancel signal each process) entered different collectives, waited until the watchdog
    stopped them, and the step's last.ckpt was never written. Here the handler only records
    the signal; before each optimizer step's first batch, the ranks add up their records in
    one all_reduce, on a gloo group of their own: host memory, no device sync. Lightning's
    handler is replaced for the fit, so its flag stays down and its checks never fire.

    Under SLURM, SIGUSR1 (Lightning's requeue signal: `#SBATCH --signal=USR1@90` without
    scripts/train.sbatch's `B:`) stops every rank the same way, and then rank 0 requeues the
    job (requeue_when_asked), which resumes from last.ckpt with ckpt_path=last. Lightning's
    own handler saved on each signalled rank in a barrier the others never reached: the ranks
    hung, or timed out, unsaved.
    """

    def __init__(self) -> None:
        self.signalled = NOTHING  # or STOP, or REQUEUE: the strongest request so far
        self.agreed_at_fit_end = NOTHING
        self._group: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # every rank, in the same order: creating a group is itself a collective
        if stage == "fit" and trainer.world_size > 1 and self._group is None:
            timeout = getattr(trainer.strategy, "collective_timeout_s", None)
            self._group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=timeout) if timeout else None
            )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Its sockets and threads go with the fit: a multirun's next job starts its own group,
        # and ddp_spawn's ranks exit without the interpreter's clean-up.
        if stage == "fit" and self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None

    # After Lightning installs its handler (at the start of the fit stage), which it puts back
    # at the stage's end; the sanity check runs first when there is one.
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._listen(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._listen(trainer)

    def _listen(self, trainer: L.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, partial(self._record, trainer.global_rank, STOP))
        if SLURMEnvironment.detect():
            signal.signal(signal.SIGUSR1, partial(self._record, trainer.global_rank, REQUEUE))

    def _record(self, rank: int, request: int, signum: int, frame: FrameType | None) -> None:
        if request > self.signalled:
            name = signal.Signals(signum).name
            then = ", then the job is requeued" if request == REQUEUE else ""
            log.info(f"rank {rank}: {name}: every rank stops before its next training step{then}")
            self.signalled = request

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return  # the optimizer step under way has batches still to accumulate
        # before this batch's step, which ResumeCheckpoint's save counts back
        self._stop_if(self._requested())

    def on_train_batch_end(self, *args: Any) -> None:
        note_progress()

    def on_validation_batch_end(self, *args: Any) -> None:
        note_progress()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A signal after the last training step (in the last validation): the fit ended as
        # planned, and its test or the sweep's next job went on until the scheduler's kill.
        # Every rank ends its training here, in the same order; the stop comes in on_fit_end,
        # after the checkpoint callbacks' on_train_end, on what the ranks agreed here (a signal
        # after that is left to the watchdog, as one after the fit was before).
        self.agreed_at_fit_end = self._requested()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if(self.agreed_at_fit_end)

    def _requested(self) -> int:
        """The strongest request of any rank (a collective)."""
        request = torch.tensor(self.signalled)
        if self._group is not None:
            torch.distributed.all_reduce(request, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return int(request.item())

    def _stop_if(self, request: int) -> None:
        if request == REQUEUE:
            raise RequeueRequested(128 + signal.SIGUSR1)
        if request == STOP:
            raise SIGTERMException(128 + signal.SIGTERM)


# What a rank was asked, by a signal, to do after its last step (StopTogetherOnSigterm).
NOTHING, STOP, REQUEUE = 0, 1, 2


class RequeueRequested(SIGTERMException):
    """Every rank stopped on SLURM's requeue signal (SIGUSR1); last.ckpt is written."""


@contextmanager
def requeue_when_asked(trainer: L.Trainer) -> Iterator[None]:
    """Around fit: once every rank has stopped on SIGUSR1 and last.ckpt is written, rank 0
    requeues the SLURM job, as Lightning's own handler does (scontrol requeue)."""
    try:
        yield
    except RequeueRequested:
        if trainer.is_global_zero:
            array = os.environ.get("SLURM_ARRAY_JOB_ID")
            job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
            try:
                requeued = subprocess.run(["scontrol", "requeue", job], check=False).returncode == 0
            except OSError:  # no scontrol here (inside a container)
                requeued = False
            if requeued:
                log.info(f"requeued SLURM job {job}: it resumes from last.ckpt with ckpt_path=last")
            else:
                log.error(f"error: scontrol requeue {job} failed: requeue it yourself, or resubmit")
        raise


# What gloo raises when a collective times out, and when a peer rank is gone mid-collective.
TIMED_OUT = "Timed out"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
# What torch's store raises when the ranks do not all join: on rank 0, which serves it, and
# on the others, which connect to it.
NOT_JOINED = ("waiting for clients", "while trying to connect to")


def is_joining_failure(error: BaseException) -> bool:
    """The ranks did not all join the process group in time."""
    return isinstance(error, torch.distributed.DistError) and any(s in str(error) for s in NOT_JOINED)


def is_explained_elsewhere(error: BaseException) -> bool:
    """An error whose cause another line names: a collective that failed (in its own line),
    a spawned rank's error (in that rank's) or death (in ddp_spawn's launching process's)."""
    return is_collective_failure(error) or isinstance(error, ProcessException)


def is_collective_failure(error: BaseException) -> bool:
    """A collective timed out or lost a peer: the process group is of no more use."""
    message = str(error)
    return isinstance(error, RuntimeError) and (
        TIMED_OUT in message or any(gone in message for gone in PEER_GONE)
    )


class JobFailed(CompactHydraException):
    """A job of a sweep that ended with one line: Hydra records it as failed, runs the
    sweep's other jobs, and at the end names the job and prints the line (exit code 1)."""


def job_end(message: str, exit_code: int) -> BaseException:
    """What ends a job whose error `message` was logged: SystemExit(exit_code); in a sweep
    (-m) a failed job, where SystemExit would end the sweep at it."""
    if in_sweep():
        return JobFailed(message)
    return SystemExit(exit_code)


def rank_lost(rank: int, how: str) -> str:
    """The line for a rank whose process ended `how` ("by SIGKILL") without a word."""
    return (
        f"rank {rank}'s process ended {how} without an error of its own (killed, or out of host "
        f"memory?): {resume_overrides()} resumes from the last periodic or epoch save"
    )


def killed_ranks(trainer: L.Trainer) -> list[str]:
    """A line for each rank that strategy=ddp's launching process started and a signal ended
    (SIGKILL: out of host memory?), which said nothing of it; ddp_spawn's launcher names them."""
    started = getattr(getattr(trainer.strategy, "launcher", None), "procs", [])
    first = trainer.node_rank * trainer.num_devices + 1
    return [
        rank_lost(rank, f"by {signal.Signals(-process.returncode).name}")
        for rank, process in enumerate(started, start=first)
        if (process.poll() or 0) < 0
    ]


@contextmanager
def explain_collective_failure(trainer: L.Trainer) -> Iterator[None]:
    """A collective that timed out or lost its peer, or ranks that did not all join, become
    one line and exit code 3."""
    try:
        yield
    except ProcessExitedException as error:  # ddp_spawn's launching process: a rank's process died
        how = f"by {error.signal_name}" if error.signal_name else f"with exit code {error.exit_code}"
        message = rank_lost(error.error_index, how)
        log.error(f"error: {message}")
        raise job_end(message, 3) from None
    except RuntimeError as error:
        if is_joining_failure(error):
            timeout = getattr(trainer.strategy, "startup_timeout_s", None)
            message = (
                f"rank {trainer.global_rank}: the {trainer.world_size} ranks did not all join"
                + (f" within {timeout:.0f} s" if timeout else "")
                + f" ({error}): start every node's command with the same trainer.num_nodes, "
                "MASTER_ADDR and MASTER_PORT, or raise trainer.strategy.startup_timeout_s (with "
                "strategy=ddp or ddp_spawn)"
            )
            log.error(f"error: {message}")
            raise job_end(message, 3) from None
        if not is_collective_failure(error):
            raise
        message = str(error)
        module = trainer.lightning_module
        hook = getattr(module, "_current_fx_name", None) or "an unknown hook"
        if TIMED_OUT in message:
            timeout = getattr(trainer.strategy, "collective_timeout_s", None)
            why = (
                f"a collective in {hook} timed out" + (f" after {timeout:.0f} s" if timeout else "") + ": "
                "another rank never entered it: it is stuck (loading data from a file system that "
                "stopped answering?), or the ranks' collectives differ (every rank must enter each "
                "all_reduce, all_gather and barrier in the same order; see utils/callbacks.py)"
            )
        else:
            why = f"another rank stopped during a collective in {hook} (its error, if it had one, is above)"
        message = f"rank {trainer.global_rank}: {why}"
        log.error(f"error: {message}")
        for line in killed_ranks(trainer):
            log.error(f"error: {line}")
        raise job_end(message, 3) from None
