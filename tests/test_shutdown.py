"""A multi-process run that breaks the collective rules, or gets a signal while stuck,
ends: with one line naming the rank and the hook, and no process left behind."""

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from navit_lightning.strategies.ddp import _HydraJobLauncher, _JobRankObserver, end_processes
from navit_lightning.utils.launch import resume_overrides
from navit_lightning.utils.shutdown import (
    GRACE_S,
    NOTHING,
    REQUEUE,
    STOP,
    RequeueRequested,
    StopTogetherOnSigterm,
    descendants,
    killed_ranks,
    requeue_when_asked,
)
from tests.conftest import DDP_TWO_RANKS, REPO, TINY_RUN, free_port, on_two_gloo_ranks, run_whole

pytestmark = pytest.mark.slow

ASYMMETRIC = [
    *TINY_RUN,
    *DDP_TWO_RANKS,
    "+callbacks.asymmetric._target_=tests.collectives.ReduceAtTrainEpochEnd",
]


def processes_of(root: Path) -> list[int]:
    """Processes still running with this test's PROJECT_ROOT."""
    mine = f"PROJECT_ROOT={root}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mine in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def test_a_rank_asymmetric_collective_ends_the_run_with_one_line_per_rank(run_entry_point):
    start = time.monotonic()
    result = run_entry_point(
        "train.py", *ASYMMETRIC, "trainer.strategy.collective_timeout_s=10", check=False, timeout=240
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-3000:]
    timed_out = "a collective in on_train_epoch_end timed out after 10 s"
    # the rank that entered its collective first times out first; the other may see it leave
    peer_left = "another rank stopped during a collective in on_train_epoch_end"
    lines = {rank: re.search(rf"error: rank {rank}: ([^:(]+)", output) for rank in (0, 1)}
    assert all(lines.values()), output[-3000:]
    ends = [line.group(1).strip() for line in lines.values()]
    assert timed_out in ends and set(ends) <= {timed_out, peer_left}, ends
    assert "Traceback" not in output
    assert time.monotonic() - start < 120
    assert not processes_of(run_entry_point.root)


@pytest.mark.parametrize(("node_rank", "devices"), [(0, 1), (1, 2)], ids=["node-0", "node-1-two-devices"])
def test_a_node_that_never_starts_ends_the_run_with_one_line(run_entry_point, node_rank, devices):
    """The README's multi-node launch by hand, one node of two started alone: it waits for
    the other node startup_timeout_s, not collective_timeout_s, then ends with one line. On
    node 1, the rank Lightning starts beside the node's first died at once (Hydra refused the
    quiet-rank settings its command was given twice), and node 0 waited for it in vain."""
    start = time.monotonic()
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        "strategy=ddp",
        "trainer.accelerator=cpu",
        f"trainer.devices={devices}",
        "trainer.num_nodes=2",
        "trainer.strategy.collective_timeout_s=1",
        "trainer.strategy.startup_timeout_s=8",
        check=False,
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": str(node_rank)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-3000:]
    first = node_rank * devices
    assert f"error: rank {first}: the {2 * devices} ranks did not all join within 8 s (" in output
    for rank in range(first, first + devices):  # every rank of the node started and waited
        assert f"Initializing distributed: GLOBAL_RANK: {rank}," in output, output[-3000:]
    # the join waited startup_timeout_s, not the collective's 1 s (torch's own figure on node 0)
    waited = re.search(r"Timed out after (\d+) seconds|timed out after (\d+)ms", output)
    assert waited and int(waited.group(1) or int(waited.group(2)) // 1000) >= 8, output[-3000:]
    assert "Traceback" not in output
    assert 8 < time.monotonic() - start < 120


def test_a_spawned_rank_killed_ends_the_run_with_one_line(run_entry_point):
    """Under ddp_spawn the launching process learns of it from torch's spawn: a traceback of
    it, and a line that the launching process (which trains nothing) could not save."""
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        "strategy=ddp_spawn",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        "+callbacks.interrupt.step=2",
        "+callbacks.interrupt.how=sigkill",
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-3000:]
    assert re.search(r"error: rank [01]'s process ended by SIGKILL without an error of its own", output)
    assert "Traceback" not in output and "not saved" not in output, output[-3000:]


def test_sigterm_ends_a_run_stuck_in_a_collective_within_seconds(run_entry_point, tmp_path):
    """A scheduler's cancel reaches only the launching process: it and its ranks end."""
    env = {**os.environ, "PROJECT_ROOT": str(run_entry_point.root)}
    log = tmp_path / "output.txt"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *ASYMMETRIC],
            cwd=run_entry_point.root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            # Rank 0 is stuck before it gets there: in its progress bar's sync of the metrics.
            while "rank 1: reducing in on_train_epoch_end" not in log.read_text():
                assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            ranks = descendants(launcher.pid)
            assert ranks, "rank 1 runs as a child of the launching process"
            time.sleep(2)  # both ranks are inside their mismatched collectives now
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=GRACE_S + 15)
        finally:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "SIGTERM not handled within" in log.read_text()
    time.sleep(1)
    assert not processes_of(run_entry_point.root)


def test_the_suites_runner_ends_every_process_of_a_command_that_timed_out(tmp_path):
    """run_whole, which runs the entry points in the tests: a hung run's other ranks and
    workers must end with its test, not run on beside the rest of the suite."""
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path)}
    with pytest.raises(subprocess.TimeoutExpired):
        run_whole("sleep 300 & sleep 300 & wait", shell=True, env=env, timeout=2)
    time.sleep(1)
    assert not processes_of(tmp_path)


def test_a_requeue_without_scontrol_ends_with_its_line(monkeypatch, tmp_path, caplog):
    """Inside a container scontrol is often missing: the stop ended in a FileNotFoundError."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with pytest.raises(RequeueRequested), requeue_when_asked(SimpleNamespace(is_global_zero=True)):
        raise RequeueRequested(128 + signal.SIGUSR1)
    assert "error: scontrol requeue 77 failed: requeue it yourself, or resubmit" in caplog.text


@pytest.mark.parametrize(("is_global_zero", "requeued"), [(True, True), (False, False)])
def test_only_rank_zero_runs_scontrol_requeue(monkeypatch, tmp_path, is_global_zero, requeued):
    """Every rank stops on SIGUSR1, and each would requeue the job once more: rank 0 alone
    runs `scontrol requeue`."""
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    trainer = SimpleNamespace(is_global_zero=is_global_zero)
    with pytest.raises(RequeueRequested), requeue_when_asked(trainer):
        raise RequeueRequested(128 + signal.SIGUSR1)
    assert (calls.read_text() if calls.exists() else "") == ("requeue 77\n" if requeued else "")


def test_a_sigterm_after_slurms_requeue_signal_still_requeues():
    """At the time limit SLURM sends SIGUSR1 (requeue), then SIGTERM: the weaker request
    must not replace the stronger one, or the job stopped without being requeued."""
    callback = StopTogetherOnSigterm()
    callback._record(0, REQUEUE, signal.SIGUSR1, None)
    callback._record(0, STOP, signal.SIGTERM, None)
    assert callback.signalled == REQUEUE
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    with pytest.raises(RequeueRequested):
        callback.on_train_batch_start(trainer, None, None, 0)


# What each rank asked, in turn, and what every rank must then do: the strongest request.
RANK_REQUESTS = [(STOP, STOP), (REQUEUE, STOP), (NOTHING, STOP), (NOTHING, NOTHING)]
AGREED = [STOP, REQUEUE, STOP, NOTHING]


def stop_together(rank: int, at_fit_end: bool) -> list[str]:
    """StopTogetherOnSigterm's decision on `rank` of a 2-rank group for each of RANK_REQUESTS:
    before a training step, or (`at_fit_end`) at the fit's end, after its last step."""
    trainer = SimpleNamespace(
        world_size=2, accumulate_grad_batches=1, strategy=SimpleNamespace(collective_timeout_s=30)
    )
    callback = StopTogetherOnSigterm()
    callback.setup(trainer, None, "fit")
    decisions = []
    for requests in RANK_REQUESTS:
        callback.signalled = NOTHING
        if requests[rank] != NOTHING:
            signum = signal.SIGUSR1 if requests[rank] == REQUEUE else signal.SIGTERM
            callback._record(rank, requests[rank], signum, None)
        try:
            if at_fit_end:
                callback.on_train_end(trainer, None)
                callback.on_fit_end(trainer, None)
            else:
                callback.on_train_batch_start(trainer, None, None, 0)
            decisions.append(NOTHING)
        except RequeueRequested:
            decisions.append(REQUEUE)
        except SIGTERMException:
            decisions.append(STOP)
    callback.teardown(trainer, None, "fit")
    return decisions


@pytest.mark.parametrize("at_fit_end", [False, True])
def test_ranks_signalled_alike_stop_alike_on_the_strongest_request(at_fit_end):
    """scancel (and torchrun, forwarding SIGTERM) signals every rank: all of them asked to
    stop must stop, not requeue (a sum of the requests said REQUEUE at 2 ranks, and nothing
    at 3); a requeue and a stop requeue. Also a signal in the last validation, after the last
    step: the fit ended as planned, and its test (or a sweep's next job) went on."""
    assert on_two_gloo_ranks(stop_together, at_fit_end) == {0: AGREED, 1: AGREED}


WORKING_AFTER_SIGTERM = """
import os, signal, sys, time
from navit_lightning.utils import shutdown

shutdown.end_promptly_on_signals(grace_s=1.0)
signal.signal(signal.SIGTERM, lambda *_: None)  # recorded, as StopTogetherOnSigterm does
os.kill(os.getpid(), signal.SIGTERM)
print(time.monotonic(), flush=True)  # the system's clock: the test reads it too
for _ in range(10):  # batches of a validation, 0.3 s each, to the next training step
    time.sleep(0.3)
    shutdown.note_progress()
time.sleep(5)  # then stuck
"""


def test_the_watchdogs_grace_runs_from_the_last_batch_after_a_signal(tmp_path):
    """A SIGTERM in a validation longer than the grace killed the run unsaved: it stops at
    the next training step. Stuck (no batch ends), it is ended after the grace."""
    script = tmp_path / "working.py"
    script.write_text(WORKING_AFTER_SIGTERM)
    result = run_whole([sys.executable, str(script)], timeout=60)
    took = time.monotonic() - float(result.stdout)
    assert result.returncode == 128 + signal.SIGTERM and "no batch ended" in result.stderr, result.stderr
    assert 4.0 <= took < 10.0, took  # 3 s of batches, then the grace (killed 1 s after the signal before)


@pytest.mark.parametrize("in_sweep", [False, True])
def test_a_failed_rank_ends_the_launching_process_after_the_grace_outside_a_sweep_only(in_sweep):
    """Once a popen rank fails, the others are killed; the launching process (rank 0) too,
    after grace_s, but not in a sweep, where it runs the sweep's later jobs."""
    failed = subprocess.Popen(["sh", "-c", "exit 1"])
    failed.wait(timeout=30)
    other_rank = subprocess.Popen(["sleep", "60"])
    launching = subprocess.Popen(["sleep", "60"])  # stands in for the process that started the ranks
    try:
        observer = _JobRankObserver([failed, other_rank], in_sweep=in_sweep)
        observer._main_pid = launching.pid  # not this test's own process
        observer.grace_s = 0.5
        start = time.monotonic()
        assert observer._run()  # its watch ends
        took = time.monotonic() - start
        assert other_rank.wait(timeout=10) == -signal.SIGKILL
        if in_sweep:
            time.sleep(0.5)
            assert launching.poll() is None
        else:
            assert launching.wait(timeout=5) == -signal.SIGKILL
            assert took >= observer.grace_s
    finally:
        other_rank.kill()
        launching.kill()
        other_rank.wait()
        launching.wait()


def test_ranks_are_stopped_at_the_launching_processs_exit_after_a_failed_stage_only(monkeypatch):
    """After a run that went well a rank still writing its last files is left to finish."""
    registered = []
    monkeypatch.setattr(atexit, "register", lambda *call: registered.append(call))
    environment = SimpleNamespace(creates_processes_externally=True, validate_settings=lambda **_: None)
    launcher = _HydraJobLauncher(environment, num_processes=2, num_nodes=1)
    assert launcher.launch(lambda: "fitted") == "fitted" and registered == []

    def failed_stage():
        raise RuntimeError("a collective timed out")

    with pytest.raises(RuntimeError):
        launcher.launch(failed_stage)
    assert registered == [(end_processes, launcher.procs, launcher.grace_s)]


def test_the_launching_process_ending_stops_the_ranks_that_outlive_its_grace():
    """A rank stuck outside any collective (a hung loader worker) outlived its rank 0, which
    had ended on the collective timeout, for good. One ending of its own is waited for; one
    that ignores SIGTERM is killed."""
    ending = subprocess.Popen(["sleep", "0.2"])
    stuck = subprocess.Popen(["sleep", "60"])
    deaf = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"])
    time.sleep(0.2)  # the shell has set its trap
    start = time.monotonic()
    try:
        end_processes([ending, stuck, deaf], grace_s=1.0, stop_s=1.0)
        assert [ending.returncode, stuck.returncode, deaf.returncode] == [0, -signal.SIGTERM, -signal.SIGKILL]
        assert 2.0 <= time.monotonic() - start < 10
    finally:
        for process in (stuck, deaf):
            process.kill()
            process.wait()


def test_a_rank_killed_without_a_word_is_named_by_the_launching_process():
    """Under ddp rank 0 said only that another rank stopped during a collective; ddp_spawn's
    launching process named the rank and its signal."""
    killed = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    failed = subprocess.Popen(["sh", "-c", "exit 2"])  # its own error is in its output
    for process in (killed, failed):
        process.wait(timeout=30)
    launcher = SimpleNamespace(procs=[failed, killed])
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher), node_rank=1, num_devices=3)
    assert killed_ranks(trainer) == [
        "rank 5's process ended by SIGKILL without an error of its own (killed, or out of host "
        f"memory?): {resume_overrides()} resumes from the last periodic or epoch save"
    ]
    assert killed_ranks(SimpleNamespace(strategy=SimpleNamespace(), node_rank=0, num_devices=1)) == []
