"""train.py and eval.py run end to end in subprocesses, as a user types them."""

import contextlib
import logging
import os
import re
import shutil
import sys
import warnings
from types import SimpleNamespace

import hydra
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from navit_lightning.errors import ConfigError
from navit_lightning.utils import entry_point
from navit_lightning.utils.callbacks import StopEarly
from navit_lightning.utils.entry_point import files_from_the_command_folder, tidy_lightning_output
from tests.conftest import DDP_TWO_RANKS, REPO, TINY_RUN, TINY_SET, logged_scalars, run_folder, run_whole
from tests.test_configs import compose_train
from tests.test_lit_module import bare_trainer, make_batch, make_model

pytestmark = pytest.mark.slow


def only(paths):
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


def assert_run_folder(run, validated: bool = True):
    checkpoints = run / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    # The best checkpoint by val/acc exists once a validation has run.
    assert bool(list(checkpoints.glob("epoch_*.ckpt"))) == validated
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def assert_written_once_by_rank_zero(run, steps_per_rank: int | None = None, ranks: int = 2):
    """One log file, written by rank 0 only, showing equal batch counts on every rank."""
    assert_run_folder(run)
    assert [path.name for path in run.glob("*.log")] == ["train.log"]
    log = (run / "train.log").read_text()
    assert "[rank: 1]" not in log and "GLOBAL_RANK: 1" not in log and log.count("Config:") == 1
    counts = re.findall(r"training batches per rank: \[([\d, ]+)\]", log)
    assert len(counts) == 1, counts
    batches = {int(count) for count in counts[0].split(", ")}
    assert len(counts[0].split(", ")) == ranks and len(batches) == 1, counts
    assert (batches == {steps_per_rank}) if steps_per_rank else (min(batches) > 1)


def assert_sane_rates(output: str) -> None:
    """The end-of-run sweep's rates are timed in the ranks (under ddp_spawn not in the
    caller, whose clock never started: it once printed 48,000,000,000 images/s)."""
    rates = [float(rate.replace(",", "")) for rate in re.findall(r"([0-9,]+) images/s", output)]
    assert rates and all(0 < rate < 1e6 for rate in rates), rates


def test_lightnings_warning_about_pinned_loaders_made_anew_is_dropped():
    """On a GPU every run warned that pinned memory, persistent workers and loaders reloaded
    at every epoch are unstable: its PyTorch issue is a new loader each epoch, and the
    datamodule hands back the same one (test_datamodule)."""
    from lightning.pytorch.trainer.connectors.data_connector import _worker_check

    loader = DataLoader(range(4), num_workers=2, persistent_workers=True, pin_memory=True)
    trainer = SimpleNamespace(num_devices=1, reload_dataloaders_every_n_epochs=1)
    with warnings.catch_warnings(record=True) as shown:  # the filters as they are
        tidy_lightning_output()
        _worker_check(trainer, loader, "train_dataloader")
    assert not [w for w in shown if "pin_memory" in str(w.message)], [str(w.message) for w in shown]


def test_the_log_file_writes_a_file_name_that_is_not_utf8_escaped(tmp_path):
    """An old zip's caf\xe9.jpg named in a warning: the log file's line failed with a
    traceback of logging's, and train.log lacked it."""
    root = logging.getLogger()
    handlers = [
        logging.FileHandler(tmp_path / "train.log", delay=True),  # Hydra's, for a run's ranks
        logging.FileHandler(tmp_path / "opened.log"),
    ]
    # these alone: pytest's capture of the record went to xdist's controller, which takes UTF-8
    kept, root.handlers = root.handlers, handlers
    try:
        tidy_lightning_output()
        root.warning("%s: not a readable image", os.fsdecode(b"caf\xe9.jpg"))
    finally:
        root.handlers = kept
        for handler in handlers:
            handler.close()
    for log in ("train.log", "opened.log"):
        # as the console writes it (sys.stderr's backslashreplace)
        assert (tmp_path / log).read_text() == "caf\\udce9.jpg: not a readable image\n"


@pytest.mark.parametrize(
    ("settings", "from_checkpoint", "refusal"),
    [
        ({"input": "", "ckpt_path": "run.ckpt"}, True, "input= names no file"),  # predicted the cwd
        ({"input": None, "ckpt_path": "run.ckpt"}, True, "input=null names no file"),  # Path(None)
        ({"ckpt_path": None}, True, "ckpt_path=null names no file"),
        ({"ckpt_path": ""}, False, "ckpt_path= names no file"),
        ({"ckpt_path": None, "init_from": None}, False, None),  # train.py from fresh weights
    ],
)
def test_an_empty_path_or_a_null_one_the_command_needs_is_refused(settings, from_checkpoint, refusal):
    cfg = OmegaConf.create(settings)
    with pytest.raises(ConfigError, match=re.escape(refusal)) if refusal else contextlib.nullcontext():
        files_from_the_command_folder(cfg, from_checkpoint)


@pytest.mark.parametrize("started_as", ["symlink", "module"])
def test_runs_go_under_the_checkout_however_train_py_is_started(tmp_path, started_as):
    """From another folder, through a symlink to train.py (logs and a second copy of the data
    set went into the symlink's folder) or as python -m (into the working folder)."""
    (tmp_path / "train.py").symlink_to(REPO / "train.py")
    command = ["train.py"] if started_as == "symlink" else ["-m", "navit_lightning.train"]
    env = {key: value for key, value in os.environ.items() if key != "PROJECT_ROOT"}
    result = run_whole(
        [sys.executable, *command, "--cfg", "job", "--resolve", "--package", "paths"],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    paths = OmegaConf.create(result.stdout.split("\n", 1)[1])  # after its "# @package" line
    assert (paths.data_dir, paths.log_dir) == (str(REPO / "data"), str(REPO / "logs"))


def test_an_installed_copy_without_the_checkouts_configs_says_so(monkeypatch):
    """pip install . (not -e) copies the package alone: Hydra's "Primary config directory
    not found", or a traceback for --help."""
    monkeypatch.setattr(entry_point, "CONFIG_DIR", "/nowhere/configs")
    with pytest.raises(SystemExit, match=re.escape("the Hydra configs are not at /nowhere/configs: ")):
        entry_point.launch(lambda: None)


def test_train_then_eval_reports_accuracy(run_entry_point):
    train = run_entry_point("train.py", *TINY_RUN)
    run = run_folder(run_entry_point.root)
    assert_run_folder(run)
    output = train.stdout + train.stderr
    assert "training batches per rank: [" in output
    log = (run / "train.log").read_text()
    assert "world size 1" in log
    # the test's result in one line, in the log file too, of the checkpoint it tested
    assert re.search(r"test accuracy: [0-9.]+ on 48 images \(.*/checkpoints/epoch_000.ckpt\)", log)
    # Lightning's noise that asks nothing of the user is dropped (tidy_lightning_output).
    for noise in ("LeafSpec", "on_before_batch_transfer", "litlogger"):
        assert noise not in output, noise
    assert "could not be decoded" not in output  # every image decodes: no report of 0 skipped
    assert "of other types left out" not in output  # the built-in set's marker is its own
    # the test and the patch budgets evaluate the fit's best checkpoint, not its last weights
    best = f"Loaded model weights from the checkpoint at {run}/checkpoints/epoch_000.ckpt"
    assert output.count(best) == 2, output[-3000:]

    # The checkpoint alone says which network and data: no overrides needed. Named from the
    # folder the command ran in, also where the job runs in its run folder (it was refused)
    last = run.relative_to(run_entry_point.root) / "checkpoints" / "last.ckpt"
    result = run_entry_point("eval.py", f"ckpt_path={last}", "hydra.job.chdir=true")
    accuracy = re.search(r"test accuracy: ([0-9.]+) on (\d+) images", result.stdout + result.stderr)
    assert accuracy and 0.0 <= float(accuracy.group(1)) <= 1.0
    # its TensorBoard says what it evaluated (its hparams.yaml was {})
    (evaluated,) = (run_entry_point.root / "logs" / "eval" / "runs").glob("*/tensorboard/hparams.yaml")
    hparams = OmegaConf.load(evaluated)
    assert (hparams.ckpt_path, hparams.split) == (str(run_entry_point.root / last), "test")
    assert hparams.data.root == str(run_entry_point.root / TINY_SET)

    # train=false tests the checkpoint it is given (it tested the initial weights)
    tested = run_entry_point(
        "train.py",
        *TINY_RUN,
        "train=false",
        f"ckpt_path={last}",
        "patch_budgets=null",
        "hydra.job.chdir=true",
    )
    test_acc = re.search(r"test accuracy: ([0-9.]+) on (\d+) images \((.*)\)", tested.stdout)
    assert test_acc and test_acc.group(1, 2) == accuracy.group(1, 2) and test_acc[3].endswith("last.ckpt")

    # The same network on another folder of images.
    images = run_entry_point.root / TINY_SET / "val"
    result = run_entry_point(
        "eval.py",
        f"ckpt_path={run}/checkpoints/last.ckpt",
        "split=val",
        "data=imagefolder",
        f"data.root={images}",
        "data.num_workers=0",
    )
    # a folder the run did not train on is evaluated whole (it scored its 10 % held out)
    assert re.search(r"val accuracy: [0-9.]+ on 48 images", result.stdout + result.stderr)
    assert "val/acc_best" not in result.stdout  # the training run's best, mixed with this score

    # A folder with other classes would be scored against the wrong labels: refused.
    renamed = run_entry_point.root / "renamed"
    shutil.copytree(images, renamed)
    first = sorted(path.name for path in renamed.iterdir() if path.is_dir())[0]
    (renamed / first).rename(renamed / "zebra")
    result = run_entry_point(
        "eval.py",
        f"ckpt_path={run}/checkpoints/last.ckpt",
        "data=imagefolder",
        f"data.root={renamed}",
        check=False,
    )
    assert result.returncode == 2
    assert f"(1 not trained on: zebra; 1 missing: {first}): use data with the same class folders" in (
        result.stdout + result.stderr
    )


@pytest.mark.parametrize(
    "callbacks", [[], ["callbacks=default", "callbacks.learning_rate_monitor=null"]], ids=["none", "default"]
)
def test_debug_fdr_runs_a_batch_of_each_stage_and_writes_nothing_but_hydras_own(run_entry_point, callbacks):
    """It ran the sweep of patch budgets too: four more evaluations, and their csv and figure.
    With the default callbacks it wrote checkpoints/last.ckpt (Lightning's save at the end of
    fit, which fast_dev_run did not stop)."""
    result = run_entry_point("train.py", *TINY_RUN, "debug=fdr", *callbacks)
    assert "Running in `fast_dev_run` mode" in result.stdout + result.stderr
    run = run_folder(run_entry_point.root)
    assert sorted(path.name for path in run.iterdir()) == [".hydra", "train.log"]


def test_four_ranks_on_cpu_with_the_default_callbacks(run_entry_point):
    """A whole epoch with validation, then the test, the progress bar and every default
    callback on: every rank enters every collective in the same order (2 ranks of ddp and
    ddp_spawn: the README's commands, checked alike by test_readme). The blocks are also
    recomputed in the backward (grad checkpointing), as a user short of memory trains, and
    strategy=auto, given four devices, is strategy=ddp."""
    result = run_entry_point(
        "train.py",
        *TINY_RUN,
        "model.net.grad_checkpointing=true",
        "strategy=auto",
        "trainer.accelerator=cpu",
        "trainer.devices=4",
    )
    output = result.stdout + result.stderr
    assert "world size 4" in output and re.search(r"test/acc\s+│\s+[0-9.]+", output)
    assert_sane_rates(output)
    # Nothing to act on: Lightning's advice to sync an epoch's log, torch's deprecations.
    for noise in ("sync_dist=True", "is deprecated"):
        assert noise not in output, noise
    # Split evenly: every rank ran the same number of batches.
    run = run_folder(run_entry_point.root)
    assert_written_once_by_rank_zero(run, ranks=4)


def test_early_stopping_stops_every_ddp_rank_after_the_same_epoch(run_entry_point):
    """No val/acc can rise by 2: the first validation sets the best, the second stops."""
    command = [
        "train.py",
        *TINY_RUN,
        *DDP_TWO_RANKS,
        "callbacks=early_stopping",
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=2",
        "trainer.max_epochs=4",
    ]
    result = run_entry_point(*command)
    run = run_folder(run_entry_point.root)
    assert_written_once_by_rank_zero(run)
    output = result.stdout + result.stderr
    stopped = "Monitored metric val/acc did not improve in the last 1 records"
    assert f"[rank: 0] {stopped}" in output and f"[rank: 1] {stopped}" not in output, output[-3000:]
    assert len(logged_scalars(run / "tensorboard")["val/acc"]) == 2  # of trainer.max_epochs=4

    # the same command again resumes a stopped run: it stays stopped, and reports the best
    # val/acc of its fit (the value a sweep optimises), which it did not validate again
    saved = (run / "checkpoints" / "last.ckpt").read_bytes()
    events = set((run / "tensorboard").iterdir())
    result = run_entry_point(*command, "ckpt_path=last", f"hydra.run.dir={run}")
    assert "it stays stopped" in result.stdout + result.stderr
    # untouched: rewritten, it was of the next epoch, which a later resume skipped
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == saved
    best = max(acc for _, acc in logged_scalars(run / "tensorboard")["val/acc"])
    resumed = [logged_scalars(path) for path in set((run / "tensorboard").iterdir()) - events]
    logged = [acc for scalars in resumed for _, acc in scalars.get("hp/val_acc", [])]
    assert logged == [pytest.approx(best)]


def test_a_resumed_early_stop_takes_the_commands_patience_and_older_checkpoints_counts():
    """Lightning's EarlyStopping restored the checkpoint's patience (a larger one did not go
    on), and patience=0 must not stop a run that has not validated."""
    saved = EarlyStopping(monitor="val/acc", mode="max", patience=3)  # a checkpoint from before StopEarly
    saved.wait_count = 3
    for patience, stops in ((3, True), (10, False)):
        resumed = StopEarly(monitor="val/acc", mode="max", patience=patience)
        checkpoint = {saved.state_key: saved.state_dict()}
        resumed.load_state_dict(checkpoint[resumed.state_key])
        trainer = SimpleNamespace(should_stop=False)
        resumed.on_train_start(trainer, None)
        assert resumed.patience == patience and trainer.should_stop is stops
    trainer = SimpleNamespace(should_stop=False)
    StopEarly(monitor="val/acc", mode="max", patience=0).on_train_start(trainer, None)
    assert trainer.should_stop is False


@pytest.mark.parametrize(
    ("threshold", "scores", "moved", "said"),
    [
        ("stopping_threshold", [0.5, 0.95], 0.99, "val/acc=0.95 had reached stopping_threshold=0.9"),
        ("divergence_threshold", [0.5, 0.1], 0.05, "val/acc=0.1 had passed divergence_threshold=0.2"),
        ("check_finite", [0.5, float("nan")], False, "val/acc was not finite"),
    ],
)
def test_a_run_stopped_at_a_threshold_stays_stopped_until_the_threshold_moves(
    threshold, scores, moved, said, caplog
):
    """Lightning's EarlyStopping kept no decision, and the best score is not the one a
    threshold stopped at: resumed, such a run trained on to its end."""
    given = {"stopping_threshold": 0.9, "divergence_threshold": 0.2, "check_finite": True}[threshold]
    saved = StopEarly(monitor="val/acc", mode="max", patience=3, **{threshold: given})
    assert [saved._evaluate_stopping_criteria(torch.tensor(score))[0] for score in scores] == [False, True]
    for setting, stops in ((given, True), (moved, False)):
        resumed = StopEarly(monitor="val/acc", mode="max", patience=3, **{threshold: setting})
        resumed.load_state_dict(saved.state_dict())
        trainer = SimpleNamespace(should_stop=False)
        with caplog.at_level(logging.INFO):
            resumed.on_train_start(trainer, None)
        assert trainer.should_stop is stops
    assert f"{said} when this run stopped early: it stays stopped" in caplog.text


def test_a_stop_at_a_threshold_that_a_resume_went_past_holds_no_more():
    """Lightning keeps the reason of a stop after the run went on: resumed past a divergence
    and ended at max_epochs, the run stayed stopped at a later resume under a new threshold."""
    saved = StopEarly(monitor="val/loss", mode="min", divergence_threshold=5.0)
    assert [saved._evaluate_stopping_criteria(torch.tensor(loss))[0] for loss in (1.0, 6.0)] == [False, True]
    resumed = StopEarly(monitor="val/loss", mode="min")  # divergence_threshold=null goes on
    resumed.load_state_dict(saved.state_dict())
    resumed.on_train_start(SimpleNamespace(should_stop=False), None)
    assert resumed._evaluate_stopping_criteria(torch.tensor(0.5))[0] is False  # then max_epochs ended it
    later = StopEarly(monitor="val/loss", mode="min", stopping_threshold=0.6)
    later.load_state_dict(resumed.state_dict())
    trainer = SimpleNamespace(should_stop=False)
    later.on_train_start(trainer, None)
    assert trainer.should_stop is False


@pytest.mark.parametrize("patience", [-1, 1.5, True])
def test_a_patience_that_is_no_count_of_validations_is_refused(patience):
    with pytest.raises(ConfigError, match=f"patience={patience} must be a whole number, 0 or more"):
        StopEarly(monitor="val/acc", mode="max", patience=patience)


def test_early_stopping_lets_a_fit_end_before_its_first_validation():
    """trainer.max_steps inside the first epoch: the check at its end failed the run with
    "Early stopping conditioned on metric val/acc which is not available"."""
    model, batches = make_model("linear"), DataLoader([make_batch()] * 3, batch_size=None)
    trainer = bare_trainer(
        max_steps=2, callbacks=[StopEarly(monitor="val/acc", mode="max")], num_sanity_val_steps=0
    )
    trainer.fit(model, batches, batches)
    assert trainer.global_step == 2 and "val/acc" not in trainer.callback_metrics


def test_ema_weights_are_saved_and_tested_as_eval_py_tests_them(run_entry_point):
    """callbacks=ema on 2 ddp ranks: the checkpoints hold the average (the trained weights
    beside it, for a resume), and train.py's test of the best checkpoint reads what eval.py
    reads there (Lightning's own callback tested the trained weights)."""
    run_entry_point("train.py", *TINY_RUN, *DDP_TWO_RANKS, "callbacks=ema", "callbacks.ema.decay=0.9")
    run = run_folder(run_entry_point.root)
    assert_written_once_by_rank_zero(run)
    best = only((run / "checkpoints").glob("epoch_*.ckpt"))
    checkpoint = torch.load(best, weights_only=True)
    average, trained = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert average.keys() == trained.keys()
    assert not all(torch.equal(average[name], trained[name]) for name in average)
    tested = logged_scalars(run / "tensorboard")["test/loss"][-1][1]
    run_entry_point("eval.py", f"ckpt_path={best}")
    evaluation = run_folder(run_entry_point.root, "eval")
    assert logged_scalars(evaluation / "tensorboard")["test/loss"][-1][1] == pytest.approx(tested, rel=1e-5)
    # and train=false, without callbacks=ema, tests it as eval.py does
    retested = run_entry_point.root / "retested"
    run_entry_point("train.py", *TINY_RUN, "train=false", f"ckpt_path={best}", f"hydra.run.dir={retested}")
    assert logged_scalars(retested / "tensorboard")["test/loss"][-1][1] == pytest.approx(tested, rel=1e-5)


def test_two_ddp_ranks_take_the_step_of_one_process_accumulating_their_two_batches(run_entry_point):
    """The same two planned batches in one optimizer step, dealt to two ranks or accumulated
    by one process: the same weights after it (plain SGD, whose update is the gradient). The
    all_reduce of the step's image count pairs on both ranks."""
    sgd = ["optimizer._target_=torch.optim.SGD", "~optimizer.betas", "model.scheduler=null"]
    common = [*TINY_RUN, *sgd, "trainer.max_steps=1", "trainer.gradient_clip_val=null", "test=false"]
    common += ["patch_budgets=null"]
    ddp, accumulated = run_entry_point.root / "ddp", run_entry_point.root / "accumulated"
    run_entry_point("train.py", *common, *DDP_TWO_RANKS, f"hydra.run.dir={ddp}")
    run_entry_point("train.py", *common, "trainer.accumulate_grad_batches=2", f"hydra.run.dir={accumulated}")
    weights = [
        torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for run in (ddp, accumulated)
    ]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_ddp_ranks_read_the_configs_the_command_named(run_entry_point, tmp_path):
    """Rank 1 was started with neither --config-path nor the hydra.* settings: it built the
    network of the repository's configs (49 parameters against 81: DDP refused), and could
    not find an experiment in a hydra.searchpath folder (the run was killed)."""
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    tiny = configs / "model" / "navit_tiny.yaml"
    tiny.write_text(tiny.read_text().replace("depth: 4", "depth: 2"))
    extra = tmp_path / "extra" / "experiment"
    extra.mkdir(parents=True)
    (extra / "wider.yaml").write_text("# @package _global_\nmodel:\n  net:\n    dim: 48\n")
    run = run_entry_point.root / "run"
    run_entry_point(
        "train.py",
        "--config-path",
        str(configs),
        f"hydra.searchpath=[file://{extra.parent}]",
        "experiment=wider",
        *[o for o in TINY_RUN if not o.startswith("model.")],  # the configs' model counts
        *DDP_TWO_RANKS,
        "patch_budgets=null",
        f"hydra.run.dir={run}",
    )
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "depth: 2" in config and "dim: 48" in config


@pytest.mark.parametrize("ranks", [[], DDP_TWO_RANKS], ids=["one", "ddp"])
def test_a_job_logging_hydra_offers_runs(run_entry_point, ranks):
    """The run's log file name was laid over whichever job logging, and one without a file
    handler (disabled, stdout) failed at start: `Unable to configure handler 'file'`."""
    run = run_entry_point.root / "run"
    run_entry_point("train.py", "hydra/job_logging=stdout", *TINY_RUN, *ranks, f"hydra.run.dir={run}")
    assert not list(run.glob("*.log"))


def test_torchrun_two_processes_on_cpu_and_a_restart_resumes(run_entry_point):
    """Lightning detects torchrun's environment and runs ddp in the processes it started;
    they agree on one run folder (rank 0's clock) and rank 1 writes no log or .hydra. Both
    killed in epoch 1, torchrun starts them again (--max-restarts), and the new group resumes
    from epoch 0's last.ckpt in that folder: it failed to connect, having read the last
    group's addresses in the agent's store."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1")
    killed = [
        "+callbacks.interrupt._target_=tests.interruptions.InterruptAtStep",
        "+callbacks.interrupt.step=5",  # of 4 a rank an epoch
        "+callbacks.interrupt.how=sigkill",
        "+callbacks.interrupt.attempt=0",
    ]
    run_entry_point(
        "train.py",
        *TINY_RUN,
        *DDP_TWO_RANKS,
        "trainer.max_epochs=2",
        "ckpt_path=last",
        *killed,
        launcher=torchrun,
    )
    run = run_folder(run_entry_point.root)
    assert_run_folder(run)
    assert [path.name for path in run.glob("*.log")] == ["train.log"]
    log = (run / "train.log").read_text()
    assert "[rank: 1]" not in log and "GLOBAL_RANK: 1" not in log and log.count("Config:") == 2  # 2 starts
    assert f"Restored all states from the checkpoint at {run / 'checkpoints' / 'last.ckpt'}" in log
    # epoch 0 as the first start planned it, then epoch 1 as the restart trained it
    first_epoch = re.search(r"train: (\d+) batches per epoch on each of 2 rank", log).group(1)
    second_epoch = re.search(r"training batches per rank: \[(\d+), \1\]", log).group(1)
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert (last["epoch"], last["global_step"]) == (1, int(first_epoch) + int(second_epoch))


def test_same_seed_same_command_same_losses(run_entry_point):
    """The default trainer.deterministic with a loader worker (its random flips and patch
    budgets): two runs log the same losses at every step, bit for bit. The second in a new
    process, with a string hash seed of its own, as two users' runs have."""
    runs = []
    for name in ("first", "second"):
        run = run_entry_point.root / name
        # the patch budgets' sweep left out: a test of its own agrees with eval.py's
        overrides = [*TINY_RUN, "data.num_workers=1", "patch_budgets=null", f"hydra.run.dir={run}"]
        run_entry_point("train.py", *overrides, fresh_process=name == "second")
        runs.append(logged_scalars(run / "tensorboard"))
    first, second = runs
    assert len(first["train/loss_step"]) > 5
    for tag in ("train/loss_step", "val/loss", "val/acc", "test/acc"):
        assert first[tag] == second[tag], tag


@pytest.mark.slow
def test_every_epoch_trains_its_planned_batches_and_validates(run_entry_point, project_root, tmp_path):
    """Lightning counts a train loader's batches when it builds it, and an epoch's packed
    batches vary in number (two rows a batch on the tiny set: 15, 16, 15). Counted once, a
    shorter epoch skipped its validation (3 of the default run's 8) and a longer one lost its
    last batches."""
    overrides = [*TINY_RUN, "data.rows=2", "trainer.max_epochs=3", "test=false", "patch_budgets=null"]
    datamodule = hydra.utils.instantiate(compose_train(overrides, tmp_path, project_root).data)
    datamodule.setup("fit")
    sampler = datamodule.batch_sampler("train")
    planned = []
    for epoch in range(3):
        sampler.sampler.set_epoch(epoch)
        planned.append(len(sampler))
    assert len(set(planned)) > 1, planned  # the case under test
    result = run_entry_point("train.py", *overrides)
    (events,) = (run_entry_point.root / "logs" / "train" / "runs").glob("*/tensorboard")
    scalars = logged_scalars(events)
    epoch_ends = [step for step, _ in scalars["train/loss_epoch"]]
    assert list(np.diff([-1, *epoch_ends])) == planned
    assert [step for step, _ in scalars["val/acc"]] == epoch_ends
    assert f"training batches per rank: [{sum(planned)}]" in result.stdout + result.stderr
