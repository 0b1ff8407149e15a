"""Callbacks that stop a run at a chosen training step, as a crash or a scheduler would, and
one that counts what an evaluation ran."""

import os
import signal

import lightning as L

from navit_lightning.utils.shutdown import descendants


class InterruptAtStep(L.Callback):
    """At the start of global step `step`'s batch number `batch` (0, the first; with
    trainer.accumulate_grad_batches a step has several): raise an error on every rank
    (`how=error`), or on the last rank alone (`how=error_on_last_rank`: one GPU out of
    memory); send the last rank's process SIGTERM (`how=sigterm`: what a cluster's scheduler
    sends before it stops a job, and which reaches the ranks at different moments, here the
    other ranks never), or SIGUSR1 (`how=sigusr1`: SLURM's warning before a time limit; to
    the process and every process it started, `how=sigusr1_to_all`, as SLURM sends it); or
    send every rank's process SIGKILL (`how=sigkill`, a node lost: nothing runs after it);
    or ask the trainer to stop after that batch (`how=should_stop`, as trainer.max_time does).
    Under torchrun, `attempt` N: in its N-th restart of the workers only (0: the first start)."""

    def __init__(self, step: int, how: str, batch: int = 0, attempt: int | None = None) -> None:
        self.step, self.how, self.batch, self.attempt = step, how, batch, attempt
        self.batches_seen = 0  # of global step `step`

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step != self.step:
            return
        if self.attempt is not None and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) != self.attempt:
            return
        self.batches_seen += 1
        if self.batches_seen != self.batch + 1:
            return
        last_rank = trainer.global_rank == trainer.world_size - 1
        if self.how == "error" or (self.how == "error_on_last_rank" and last_rank):
            raise RuntimeError(f"interrupted at step {self.step} on purpose")
        if self.how == "should_stop":
            trainer.should_stop = True
        if self.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.how in ("sigterm", "sigusr1") and last_rank:
            os.kill(os.getpid(), signal.SIGTERM if self.how == "sigterm" else signal.SIGUSR1)
        elif self.how == "sigusr1_to_all" and last_rank:
            for pid in [os.getpid(), *descendants(os.getpid())]:
                os.kill(pid, signal.SIGUSR1)


class InterruptAfterStep(L.Callback):
    """Raise an error in the on_train_batch_end of the batch that made global step `step`, or
    (`validation=True`) in the first validation of fit after it, at its batch `batch`: a
    Ctrl-C or an error after a step and before its batch's end. `how=sigkill`: the process
    is killed there instead (a node lost)."""

    def __init__(self, step: int, validation: bool = False, batch: int = 0, how: str = "error") -> None:
        if how not in ("error", "sigkill"):
            raise ValueError(f"how={how!r}: error or sigkill")
        self.step, self.validation, self.batch, self.how = step, validation, batch, how

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step and not self.validation:
            self._interrupt(f"interrupted after step {self.step} on purpose")

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int, *args) -> None:
        fits = self.validation and not trainer.sanity_checking
        if fits and trainer.global_step == self.step and batch_idx == self.batch:
            self._interrupt(f"interrupted in the validation after step {self.step} on purpose")

    def _interrupt(self, message: str) -> None:
        if self.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)  # the process ends here
        raise RuntimeError(message)


class CountEvaluatedBatches(L.Callback):
    """Prints the batches of every validation (past the sanity check) and test, for the tests
    of what limits them."""

    def __init__(self) -> None:
        self.batches = 0

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:
        self.batches += not trainer.sanity_checking

    def on_test_batch_end(self, trainer: L.Trainer, *args) -> None:
        self.batches += 1

    def on_validation_end(self, trainer: L.Trainer, *args) -> None:
        self._report("validation", trainer)

    def on_test_end(self, trainer: L.Trainer, *args) -> None:
        self._report("test", trainer)

    def _report(self, stage: str, trainer: L.Trainer) -> None:
        if not trainer.sanity_checking:
            print(f"{stage} batches: {self.batches}", flush=True)
        self.batches = 0
