"""Each logger, debug preset and the device-stats callback in a real train.py run, offline."""

from __future__ import annotations

import csv
import logging
import math
import os
import pickle
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from omegaconf import OmegaConf

from navit_lightning.errors import OutputError
from navit_lightning.utils.loggers import (
    AppendingExperimentWriter,
    ResumableMLFlowLogger,
    instantiate_loggers,
    loggers_closed_on_failure,
)
from tests.conftest import TINY_RUN, logged_scalars, run_folder

pytestmark = pytest.mark.slow


def console_count(result: subprocess.CompletedProcess, pattern: str) -> int:
    """The number that `pattern` captures in the run's console output."""
    found = re.search(pattern, result.stdout + result.stderr)
    assert found, f"{pattern!r} not in the output:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return int(found.group(1))


def trained_batches(result: subprocess.CompletedProcess) -> int:
    return console_count(result, r"training batches per rank: \[(\d+)\]")


def csv_losses(metrics: Path) -> list[float]:
    with metrics.open() as file:
        return [float(row["train/loss_step"]) for row in csv.DictReader(file) if row["train/loss_step"]]


def test_csv_logger_writes_every_step_into_the_run_folder_and_a_resumed_run_adds_to_it(run_entry_point):
    result = run_entry_point("train.py", "logger=csv", *TINY_RUN)
    run = run_folder(run_entry_point.root)
    metrics = run / "csv" / "metrics.csv"
    first = csv_losses(metrics)
    assert len(first) == trained_batches(result)
    with metrics.open() as file:
        columns = next(csv.reader(file))
    assert {"val/acc", "test/acc", "lr-AdamW/pg1"} <= set(columns)
    assert "model:" in (run / "csv" / "hparams.yaml").read_text()
    assert not (run / "tensorboard").exists()

    resumed = run_entry_point(
        "train.py", "logger=csv", *TINY_RUN, f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_epochs=2"
    )
    losses = csv_losses(metrics)
    assert len(losses) == len(first) + trained_batches(resumed)
    assert losses[: len(first)] == first


def test_many_gives_tensorboard_and_csv_the_same_values(run_entry_point):
    run_entry_point("train.py", "logger=many", *TINY_RUN)
    run = run_folder(run_entry_point.root)
    board = [value for _, value in logged_scalars(run / "tensorboard")["train/loss_step"]]
    assert board == pytest.approx(csv_losses(run / "csv" / "metrics.csv"))
    assert len(board) > 1


def test_mlflow_logger_keeps_runs_in_one_local_database_and_a_resumed_run_goes_on_in_its_own(run_entry_point):
    mlflow = pytest.importorskip("mlflow")
    result = run_entry_point("train.py", "logger=mlflow", *TINY_RUN)
    root = run_entry_point.root
    run = run_folder(root)
    client = mlflow.MlflowClient(f"sqlite:///{root}/logs/mlflow/mlflow.db")
    experiment = client.get_experiment_by_name("train").experiment_id
    (stored,) = client.search_runs([experiment])
    assert stored.info.status == "FINISHED"
    assert stored.data.tags["run_dir"] == str(run)
    # named after its folder, not by MLflow's draw from Python's random, which the seed set
    assert stored.info.run_name == f"runs/{run.name}"
    assert stored.data.params["model/net/dim"] == "32"
    assert {"val/acc", "test/acc"} <= set(stored.data.metrics)
    losses = client.get_metric_history(stored.info.run_id, "train/loss_step")
    first = trained_batches(result)
    assert [metric.step for metric in losses] == list(range(first))
    # nothing in the working directory (mlflow's default ./mlruns)
    assert sorted(path.name for path in root.iterdir()) == ["data", "logs"]

    more = ["ckpt_path=last", "trainer.max_epochs=2"]
    resumed = run_entry_point("train.py", "logger=mlflow", *TINY_RUN, f"hydra.run.dir={run}", *more)
    (stored,) = client.search_runs([experiment])
    assert stored.info.status == "FINISHED"
    losses = client.get_metric_history(stored.info.run_id, "train/loss_step")
    assert [metric.step for metric in losses] == list(range(first + trained_batches(resumed)))
    assert [metric.step for metric in client.get_metric_history(stored.info.run_id, "val/acc")] == [
        first - 1,
        len(losses) - 1,
    ]
    # MLflow refuses to change a param: the run keeps its first values and says which differ
    assert stored.data.params["trainer/max_epochs"] == "1"
    output = resumed.stdout + resumed.stderr
    assert "keeps the params it was started with: trainer/max_epochs=1 (now 2)\n" in output


def mlflow_logger(uri: str, run_dir: str, **kwargs: Any) -> ResumableMLFlowLogger:
    return ResumableMLFlowLogger("train", tracking_uri=uri, tags={"run_dir": run_dir}, **kwargs)


def test_mlflow_logger_goes_on_with_its_folders_run_when_resumed_from_that_folder_alone(tmp_path):
    """A resume from the folder's own checkpoint (ckpt_path=last, a file in it) takes up the
    folder's run; a fresh start there, or another folder's checkpoint (eval.py's), starts one."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    folders = ("/runs/a", "/runs/b", "/runs/it's")
    first = {run_dir: mlflow_logger(uri, run_dir).run_id for run_dir in folders}
    assert len(set(first.values())) == 3
    assert {run_dir: mlflow_logger(uri, run_dir, resume_from="last").run_id for run_dir in folders} == first
    assert (
        mlflow_logger(uri, "/runs/a", resume_from="/runs/a/checkpoints/epoch_000.ckpt").run_id
        == first["/runs/a"]
    )
    for fresh in (None, "/runs/b/checkpoints/last.ckpt"):
        assert mlflow_logger(uri, "/runs/a", resume_from=fresh).run_id not in first.values()
    mlflow.MlflowClient(uri).delete_run(first["/runs/b"])  # a deleted run is not taken up again
    assert mlflow_logger(uri, "/runs/b", resume_from="last").run_id not in first.values()


def test_wandb_logger_writes_an_offline_run_into_each_jobs_folder(run_entry_point, tmp_path_factory):
    """Lightning leaves a W&B run open: a sweep's next job logged into the last one's, after
    a job that ended and after one that failed."""
    pytest.importorskip("wandb")
    home = tmp_path_factory.mktemp("wandb_home")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        # its settings and caches, in the user's home otherwise
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }
    # job 0 fails after its run started (train=false without a checkpoint), 1 and 2 train
    sweep_overrides = ["-m", "logger=wandb", "train=false,true,true", "ckpt_path=last", "patch_budgets=null"]
    result = run_entry_point("train.py", *sweep_overrides, *TINY_RUN, env=env, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    root = run_entry_point.root
    (sweep,) = (root / "logs" / "train" / "multiruns").iterdir()
    for job in ("0", "1", "2"):
        (offline,) = (sweep / job / "wandb").glob("offline-run-*")
        (history,) = offline.glob("run-*.wandb")
        # wandb's binary record log names each metric it holds
        records = history.read_bytes()
        assert (b"train/loss_step" in records and b"val/acc" in records) is (job != "0")
    assert sorted(path.name for path in root.iterdir()) == ["data", "logs"]


def test_a_wandb_loggers_folder_is_where_ddp_spawns_ranks_write_its_run(monkeypatch, tmp_path):
    """A spawned rank attaches to the launching process's W&B run and writes its files (the
    pictures) under WANDB_DIR: they went to ./wandb of the working directory, not the run's."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    group = OmegaConf.create(
        {
            "tensorboard": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "save_dir": "tb"},
            "wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger", "save_dir": str(tmp_path / "run")},
        }
    )
    loggers = instantiate_loggers(group)
    assert [type(logger) for logger in loggers] == [TensorBoardLogger, WandbLogger]
    assert os.environ["WANDB_DIR"] == str(tmp_path / "run")


def test_debug_limit_runs_a_few_batches_of_each_stage(run_entry_point):
    counted = "+callbacks.count._target_=tests.interruptions.CountEvaluatedBatches"
    result = run_entry_point("train.py", "debug=limit", *TINY_RUN, counted)
    planned = console_count(
        result, r"train: 5 batches per epoch of the (\d+) planned \(limit_train_batches=5\)"
    )
    assert trained_batches(result) == 5 < planned
    assert console_count(result, r"validation batches: (\d+)") == 2
    assert console_count(result, r"test batches: (\d+)") == 2
    # two batches at each patch budget hold fewer images at a larger one: said, not a silent
    # curve over other images at each budget
    scored = re.search(
        r"the patch budgets \[9, 16, 36, 64\] scored \[(\d+), .*, (\d+)\] images", result.stderr
    )
    assert scored and int(scored[1]) > int(scored[2]), result.stderr[-3000:]


def test_debug_overfit_memorises_the_same_two_batches(run_entry_point):
    result = run_entry_point("train.py", "debug=overfit", *TINY_RUN, "trainer.max_epochs=10")
    assert trained_batches(result) == 20
    scalars = logged_scalars(run_folder(run_entry_point.root, "debug") / "tensorboard")
    losses = [value for _, value in scalars["train/loss_step"]]
    assert len(losses) == 20
    # The loss on each batch falls every epoch, as it does only on the same images (with
    # other images at each epoch, as when the loader shuffled, it rose and fell here).
    assert all(later < earlier for earlier, later in zip(losses[:-2], losses[2:], strict=True)), losses
    assert sum(losses[-2:]) < 0.9 * sum(losses[:2]), losses
    assert "test/acc" not in scalars


def test_debug_profiler_writes_its_report_into_the_run_folder(run_entry_point):
    result = run_entry_point("train.py", "debug=profiler", *TINY_RUN)
    report = (run_folder(run_entry_point.root, "debug") / "fit-profile.txt").read_text()
    assert report.startswith("FIT Profiler Report")
    calls = re.search(r"\|\s+run_training_batch\s+\|\s+[\d.]+\s+\|\s+(\d+)\s+\|", report)
    assert calls and int(calls.group(1)) == trained_batches(result), report[:3000]


def test_device_stats_logs_the_cpu_use_at_every_logged_step(run_entry_point):
    result = run_entry_point("train.py", "callbacks=device_stats", *TINY_RUN)
    scalars = logged_scalars(run_folder(run_entry_point.root) / "tensorboard")
    for hook in ("on_train_batch_start", "on_train_batch_end"):
        for stat in ("cpu_percent", "cpu_vm_percent", "cpu_swap_percent"):
            values = scalars[f"DeviceStatsMonitor.{hook}/{stat}"]
            assert len(values) == trained_batches(result)
            assert all(0 <= value <= 100 for _, value in values)
    assert all(value > 0 for _, value in scalars["DeviceStatsMonitor.on_train_batch_end/cpu_vm_percent"])


def test_callbacks_none_writes_no_checkpoint(run_entry_point):
    """Lightning added a ModelCheckpoint of its own, into tensorboard/checkpoints/, which
    ckpt_path=last did not find."""
    run_entry_point("train.py", "callbacks=none", *TINY_RUN, "patch_budgets=null")
    assert not list((run_entry_point.root / "logs").rglob("*.ckpt"))
    run_entry_point(
        "train.py", "callbacks=none", "trainer.enable_checkpointing=true", *TINY_RUN, "test=false"
    )
    assert list((run_entry_point.root / "logs").rglob("*.ckpt"))  # Lightning's own, when asked for


def test_a_failed_job_closes_its_loggers_as_failed():
    """A job that fails must not leave its loggers marked a success: its W&B run showed
    finished, exit code 0, and MLflow's run FINISHED, for a job that had crashed."""
    csv_logger, wandb_logger = MagicMock(spec=CSVLogger), MagicMock(spec=WandbLogger)
    trainer = SimpleNamespace(loggers=[csv_logger, wandb_logger], global_step=3)
    with pytest.raises(ZeroDivisionError), loggers_closed_on_failure(trainer):
        raise ZeroDivisionError("an error in fit")
    for logger in (csv_logger, wandb_logger):
        logger.finalize.assert_called_once_with("failed")
        logger.log_metrics.assert_not_called()  # nothing final to log
    wandb_logger.experiment.finish.assert_called_once_with(exit_code=1)


def test_a_job_failed_by_a_full_disk_keeps_its_error_when_its_loggers_fail_to_close(recwarn):
    """The checkpoint's one-line error ended in Lightning's ValueError from TensorBoard, on the
    same full disk, as the run's last words (exit code 1, 150 lines of tracebacks)."""
    logger = MagicMock(spec=CSVLogger)
    disk_full = OSError(28, "No space left on device")
    logger.log_metrics.side_effect = ValueError("you tried to log 0.18")
    logger.log_metrics.side_effect.__cause__ = disk_full
    trainer = SimpleNamespace(loggers=[logger], global_step=3)
    results = {"hp/val_acc": 0.18}
    with (
        pytest.raises(OutputError, match="cannot be written"),
        loggers_closed_on_failure(trainer, lambda: results),
    ):
        raise OutputError("checkpoint last.ckpt cannot be written")
    assert "the loggers could not be closed (OSError: [Errno 28] No space left on device)" in str(
        recwarn.pop().message
    )


@pytest.mark.parametrize("step", [0, 3])
def test_a_failed_job_logs_its_results_so_far_once_it_has_trained(step):
    """TensorBoard's HPARAMS showed a stopped run's placeholders, 0.0, as its results; a
    resume refused before its first step must leave the run's own."""
    logger = MagicMock(spec=CSVLogger)
    trainer = SimpleNamespace(loggers=[logger], global_step=step)
    results = {"hp/val_acc": 0.25, "hp/test_acc": math.nan}
    with pytest.raises(KeyboardInterrupt), loggers_closed_on_failure(trainer, lambda: results):
        raise KeyboardInterrupt
    if step:
        logger.log_metrics.assert_called_once_with(results, step=step)
    else:
        logger.log_metrics.assert_not_called()


def test_mlflow_logger_reopens_its_finished_run_and_takes_the_newest_of_its_folder(tmp_path):
    """A resumed run's MLflow run showed FINISHED while it trained; one refused before it logged
    a metric (another network, a val_check_interval past the batches) keeps its status; of two
    runs of one folder (started by a version before this logger), the newest goes on; a run_id
    given is kept."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)

    first = mlflow_logger(uri, "/runs/a")
    run_id = first.run_id  # the run starts here
    first.finalize("success")
    refused = mlflow_logger(uri, "/runs/a", resume_from="last")
    assert refused.run_id == run_id
    refused.finalize("failed")
    assert client.get_run(run_id).info.status == "FINISHED"
    resumed = mlflow_logger(uri, "/runs/a", resume_from="last")
    resumed.log_metrics({"val/acc": 0.5}, step=3)
    assert resumed.run_id == run_id and client.get_run(run_id).info.status == "RUNNING"
    resumed.finalize("success")
    assert client.get_run(run_id).info.status == "FINISHED"

    experiment = client.get_experiment_by_name("train").experiment_id
    old, new = (
        client.create_run(experiment, start_time=t, tags={"run_dir": "/runs/b"}) for t in (1000, 2000)
    )
    assert mlflow_logger(uri, "/runs/b", resume_from="last").run_id == new.info.run_id
    given = mlflow_logger(uri, "/runs/b", resume_from="last", run_id=old.info.run_id)
    assert given.run_id == old.info.run_id


def test_mlflow_logger_keeps_a_params_first_value_and_adds_new_ones(tmp_path, caplog):
    """MLflow refuses to change a param: the changed one is left out, the others logged; a
    line names the changed ones but ckpt_path and resume_from, which every resume changes."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = mlflow_logger(uri, "/runs/a")
    resume = {"ckpt_path": "last", "logger": {"mlflow": {"resume_from": "last"}}}
    started = {"ckpt_path": None, "logger": {"mlflow": {"resume_from": None}}}
    first.log_hyperparams({"trainer": {"max_epochs": 1}, "seed": 42, **started})
    with caplog.at_level(logging.INFO):
        mlflow_logger(uri, "/runs/a", resume_from="last").log_hyperparams(
            {"trainer": {"max_epochs": 1}, "seed": 42, **resume}
        )
        assert "keeps the params" not in caplog.text
        resumed = mlflow_logger(uri, "/runs/a", resume_from="last")
        resumed.log_hyperparams({"trainer": {"max_epochs": 2}, "seed": 42, **resume, "new": 1})
    assert caplog.text.count("keeps the params it was started with: trainer/max_epochs=1 (now 2)\n") == 1
    params = mlflow.MlflowClient(uri).get_run(first.run_id).data.params
    assert params == {
        "trainer/max_epochs": "1",
        "seed": "42",
        "ckpt_path": "None",
        "logger/mlflow/resume_from": "None",
        "new": "1",
    }


def test_a_csv_writers_copy_adds_its_columns_to_the_rows_another_copy_wrote(tmp_path):
    """ddp_spawn hands each stage a copy of the launching process's writer: the test's copy,
    which saw none of the fit's columns, emptied metrics.csv and failed on its rows."""
    fit_stage = AppendingExperimentWriter(log_dir=str(tmp_path))
    test_stage = pickle.loads(pickle.dumps(fit_stage))
    fit_stage.log_metrics({"train/loss": 1.5}, step=0)
    fit_stage.save()
    test_stage.log_metrics({"test/acc": 0.5}, step=4)
    test_stage.save()
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert rows == [
        {"step": "0", "train/loss": "1.5", "test/acc": ""},
        {"step": "4", "train/loss": "", "test/acc": "0.5"},
    ]
