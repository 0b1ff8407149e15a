"""Accuracy across resolutions: at the end of training and from eval.py, as files, log lines
and TensorBoard entries that agree with a plain evaluation."""

import csv
import math
import re
from types import SimpleNamespace
from unittest.mock import MagicMock, call

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from navit_lightning import resolution
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.lit_module import BatchCounts, NaViTClassifier
from navit_lightning.models import NaViT
from navit_lightning.resolution import (
    BudgetResult,
    EvalCounter,
    budgets_that_fit,
    label_and_path,
    main,
    read_results,
    report,
    why_no_budget_sweep,
)
from tests.conftest import TINY_RUN, TINY_SET, TINY_SPEC, bare_trainer, logged_scalars, run_folder


def accuracy_lines(output: str, split: str) -> dict[int, float]:
    found = re.findall(
        rf"{split} at patch budget +(\d+): +[0-9.]+ patches per image, accuracy ([0-9.]+)", output
    )
    return {int(budget): float(accuracy) for budget, accuracy in found}


@pytest.mark.slow
def test_training_ends_with_accuracy_across_resolutions_and_eval_py_agrees(run_entry_point):
    """Both in two spawned ranks, as the README runs ddp_spawn: a spawned rank's metric
    states were shared with the launching process, and the sweep's first budget counted the
    fit's sanity check and each image twice."""
    spawned = ["trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp_spawn"]
    training = run_entry_point("train.py", *TINY_RUN, *spawned, "logger=many")
    # the sweep's trainer has no logger, which Lightning warned of at every count logged for one
    assert "have no logger configured" not in training.stdout + training.stderr
    run = run_folder(run_entry_point.root)
    # each stage's copy of the CSV writer adds its columns to the rows the fit wrote
    with open(run / "csv" / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert all(any(row[column] for row in rows) for column in ("train/loss_step", "val/acc", "test/acc"))
    trained = read_results(run / "resolution_accuracy.csv")
    assert [result.patch_budget for result in trained] == [9, 16, 36, 64]
    assert (run / "resolution_accuracy.png").stat().st_size > 10_000
    scalars = logged_scalars(run / "tensorboard")
    assert [step for step, _ in scalars["resolution/acc"]] == [9, 16, 36, 64]
    # at the step the ranks trained to, where the launching process logs them (the HPARAMS
    # tab declares them with no value before)
    trained_to = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    assert trained_to > 0
    assert {tag: [step for step, _ in scalars[tag]] for tag in ("test/acc", "hp/val_acc", "hp/test_acc")} == {
        "test/acc": [trained_to],
        "hp/val_acc": [trained_to],
        "hp/test_acc": [trained_to],
    }

    # counted in the ranks: the launching process of ddp_spawn has no data set up to count
    # (eval.py's line is this function's too)
    said = re.search(r"test accuracy: [0-9.]+ on (\d+) images", training.stdout)
    assert said and int(said.group(1)) == TINY_SPEC.num_test, training.stdout[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    # The sweep in two spawned ranks: the same accuracy as one process, and the warnings that
    # eval.py silences stay silent in ranks that start as fresh interpreters.
    swept = run_entry_point("eval.py", f"ckpt_path={ckpt}", "split=val", "patch_budgets=[9,36,100]", *spawned)
    output = swept.stdout + swept.stderr
    assert "Be aware that when using `ckpt_path`" not in output and "custom batch sampler" not in output
    assert "have no logger configured" not in output
    lines = accuracy_lines(output, "val")
    eval_run = next(
        (run_entry_point.root / "logs" / "eval" / "runs").glob("*/resolution_accuracy.csv")
    ).parent
    results = read_results(eval_run / "resolution_accuracy.csv")
    assert [result.patch_budget for result in results] == list(lines) == [9, 36, 100]
    # At the training run's data.max_patches (36) the sweep is the plain evaluation, which
    # the fit's validation ran on the same weights (one epoch: its best is its last); the
    # training run's sweep evaluated them too.
    assert lines[36] == pytest.approx(scalars["val/acc"][-1][1], abs=1e-4)
    trained_accuracy = {result.patch_budget: result.accuracy for result in trained}
    for budget in (9, 36):
        assert lines[budget] == pytest.approx(trained_accuracy[budget], abs=1e-4), budget
    patches = [result.patches_per_image for result in results]
    assert all(p <= budget for p, budget in zip(patches, [9, 36, 100], strict=True))
    assert patches == sorted(patches) and patches[0] < patches[-1]
    assert all(result.images_per_s > 0 for result in results)


def test_an_evaluations_seconds_are_its_batches_own_summed_over_each_loader(monkeypatch):
    """images/s per budget is images over these seconds: one batch's would overstate it; the
    time between batches held another budget's first batch's loading (Lightning fetches each
    batch before the last one runs), and a budget of one batch had none."""
    now = [0.0]
    monkeypatch.setattr(resolution.time, "perf_counter", lambda: now[0])
    logged: dict[str, list[float]] = {}
    module = SimpleNamespace(
        batch_counts=BatchCounts(images=3, real_tokens=30, tokens=40),
        log=lambda name, value, **_: logged.setdefault(name, []).append(value),
    )
    counter = EvalCounter()
    for loader, batches in enumerate((3, 1)):
        logged.clear()
        for batch_idx in range(batches):  # batches of 2 s, 10 s apart
            now[0] = 100.0 * loader + 10.0 * batch_idx
            counter.on_test_batch_start(None, module, None, batch_idx, loader)
            now[0] += 2.0
            counter.on_test_batch_end(None, module, None, None, batch_idx, loader)
        assert max(logged["test/seconds"]) == 2.0 * batches and logged["test/images"] == [3.0] * batches


def test_the_report_logs_each_budgets_accuracy_and_patches_at_the_budget_and_writes_its_csv(tmp_path):
    logger = MagicMock()
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger], global_step=5)
    results = [BudgetResult(9, 8.5, 0.5, 100.0), BudgetResult(36, 30.25, 0.75, 50.0)]
    report(results, trainer, tmp_path / "run", "val")
    assert logger.log_metrics.call_args_list == [
        call({"resolution/acc": 0.5, "resolution/patches_per_image": 8.5}, step=9),
        call({"resolution/acc": 0.75, "resolution/patches_per_image": 30.25}, step=36),
    ]
    assert read_results(tmp_path / "run" / "resolution_accuracy.csv") == results


class CountedBatches(L.LightningModule):
    """Each batch an int n: n images of 10 real tokens each, as NaViTClassifier counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.batch_counts = BatchCounts(0, 0, 0)

    def validation_step(self, batch: int, batch_idx: int) -> None:
        self.batch_counts = BatchCounts(int(batch), 10 * int(batch), 10 * int(batch))


def test_lightning_reduces_an_evaluations_seconds_to_their_maximum_and_sums_its_counts(monkeypatch):
    """accuracy_across_budgets reads each loader's values from trainer.callback_metrics: the
    seconds so far, logged after every batch, reduced by a sum instead of their maximum made
    images/s several times too low; the images and tokens must be summed."""
    clock = iter(range(100))
    monkeypatch.setattr(resolution, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    trainer = bare_trainer()
    trainer.callbacks.append(EvalCounter())
    trainer.validate(CountedBatches(), DataLoader([1, 2, 3], batch_size=None), verbose=False)
    # each batch started at an even second and ended a second later: 3 s
    assert float(trainer.callback_metrics["val/seconds"]) == 3.0
    assert float(trainer.callback_metrics["val/images"]) == 6.0
    assert float(trainer.callback_metrics["val/real_tokens"]) == 60.0


def test_images_per_second_are_images_over_each_budgets_seconds():
    """Each budget's images/s is its images over its seconds (its real tokens over them read
    as images/s several times too high), and its patches per image its real tokens over its
    images, read from its loader's metrics; the run's loggers and callbacks are put back."""
    metrics = {}
    for index, (images, real_tokens, accuracy, seconds) in enumerate(
        [(40, 360, 0.5, 2.0), (40, 1200, 0.75, 8.0)]
    ):
        for name, value in (
            ("images", images),
            ("real_tokens", real_tokens),
            ("acc", accuracy),
            ("seconds", seconds),
        ):
            metrics[f"val/{name}/dataloader_idx_{index}"] = torch.tensor(value)
    evaluated_at = []
    validations = []
    trainer = SimpleNamespace(
        validate=lambda model, **kwargs: validations.append(kwargs),
        loggers=["a logger"],
        callbacks=[],
        callback_metrics=metrics,
    )
    datamodule = SimpleNamespace(evaluate_at=evaluated_at.append)
    results = resolution.accuracy_across_budgets(trainer, None, datamodule, [9, 36], "val")
    assert results == [
        resolution.BudgetResult(9, 9.0, 0.5, 20.0),
        resolution.BudgetResult(36, 30.0, 0.75, 5.0),
    ]
    assert evaluated_at == [[9, 36], None] and len(validations) == 1
    assert trainer.loggers == ["a logger"] and trainer.callbacks == []


def test_a_single_budgets_metrics_are_read_without_a_loader_suffix():
    """With one loader Lightning keys its metrics without /dataloader_idx_0: patch_budgets
    of one budget (eval.py patch_budgets=[36]) read them by their plain names."""
    metrics = {
        f"val/{name}": torch.tensor(value)
        for name, value in (("images", 40), ("real_tokens", 1200), ("acc", 0.75), ("seconds", 8.0))
    }
    trainer = SimpleNamespace(
        validate=lambda model, **kwargs: None, loggers=[], callbacks=[], callback_metrics=metrics
    )
    datamodule = SimpleNamespace(evaluate_at=lambda budgets: None)
    results = resolution.accuracy_across_budgets(trainer, None, datamodule, [36], "val")
    assert results == [resolution.BudgetResult(36, 30.0, 0.75, 5.0)]


def test_budgets_past_the_position_tables_are_left_out_before_the_sweep(project_root):
    """At the end of a fit the sweep stopped at the first image longer than the tables (an
    error after the whole fit, hp metrics unlogged): such budgets are named and left out."""
    datamodule = PackedImageDataModule(
        str(project_root / TINY_SET), patch_size=16, max_patches=9, num_workers=0
    )
    datamodule.setup("fit")
    longest = {budget: datamodule.longest_side("val", budget)[0] for budget in (9, 36, 64)}
    assert longest[9] <= 9 < longest[64] and longest[36] <= longest[64]
    net = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=9)
    fitting = [budget for budget in (9, 36, 64) if longest[budget] <= 9]
    with pytest.warns(
        UserWarning, match=rf"patch_budgets \[64\] left out: at 64 val image {project_root / TINY_SET}\S+ is"
    ):
        assert budgets_that_fit([9, 36, 64], datamodule, net, "val") == fitting
    # tables exactly as long as the longest image: every budget fits
    exact = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=longest[64])
    assert budgets_that_fit([9, 36, 64], datamodule, exact, "val") == [9, 36, 64]
    fractional = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=9, fractional_pos=True)
    assert budgets_that_fit([9, 36, 64], datamodule, fractional, "val") == [9, 36, 64]


@pytest.mark.slow
def test_a_run_without_validation_skips_the_sweep_with_a_line(run_entry_point):
    """trainer.limit_val_batches=0 let the whole run end in a KeyError: the sweep's
    validations logged no accuracy. The HPARAMS tab showed its best val/acc at 0.0, the
    placeholder (so did a run that trainer.max_steps ended before its first validation)."""
    result = run_entry_point("train.py", *TINY_RUN, "trainer.limit_val_batches=0")
    assert "patch_budgets skipped: trainer.limit_val_batches=0" in result.stdout + result.stderr
    run = run_folder(run_entry_point.root)
    assert not (run / "resolution_accuracy.csv").exists()
    scalars = logged_scalars(run / "tensorboard")
    assert math.isnan(scalars["hp/val_acc"][-1][1])
    assert scalars["hp/test_acc"][-1][1] == scalars["test/acc"][-1][1]


def test_curves_of_several_runs_in_one_figure(tmp_path):
    rows = "patch_budget,patches_per_image,accuracy,images_per_s\n4,3.9,0.3,100\n36,34.4,0.98,50\n"
    # a sweep's job folder, named by Hydra after its overrides
    swept = tmp_path / "optimizer.lr=1e-3" / "resolution_accuracy.csv"
    swept.parent.mkdir()
    for path in (tmp_path / "variable.csv", tmp_path / "fixed.csv", swept):
        path.write_text(rows)
    main(
        [
            f"variable={tmp_path / 'variable.csv'}",
            f"fixed={tmp_path / 'fixed.csv'}",
            f"lr={swept}",
            str(swept),
            "--out",
            str(tmp_path / "both.png"),
        ]
    )
    assert read_results(tmp_path / "fixed.csv")[1].accuracy == 0.98
    assert (tmp_path / "both.png").stat().st_size > 10_000
    assert label_and_path(f"lr={swept}") == ("lr", str(swept))
    assert label_and_path(str(swept)) == ("optimizer.lr=1e-3", str(swept))
    with pytest.raises(SystemExit):
        main([f"lr={tmp_path / 'missing.csv'}", "--out", str(tmp_path / "none.png")])
    same_label = [f"x={tmp_path / 'variable.csv'}", f"x={tmp_path / 'fixed.csv'}"]
    with pytest.raises(SystemExit):  # job 0 of two sweeps: one curve replaced the other
        main([*same_label, "--out", str(tmp_path / "x.png")])
    (tmp_path / "other.csv").write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(SystemExit):  # a KeyError traceback
        main([str(tmp_path / "other.csv"), "--out", str(tmp_path / "x.png")])
    (tmp_path / "unfinished.csv").write_text(rows.replace("0.98", "n/a"))
    with pytest.raises(SystemExit):  # a ValueError traceback
        main([str(tmp_path / "unfinished.csv"), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit):  # matplotlib's traceback after the csv files were read
        main([str(swept), "--out", str(tmp_path / "x.xyz")])
    main([str(swept), "--out", str(tmp_path / "new" / "folder" / "one.PDF")])  # made, not a traceback
    assert (tmp_path / "new" / "folder" / "one.PDF").read_bytes().startswith(b"%PDF")


class OneLoaderValidation(NaViTClassifier):
    """Lightning's documented two-argument validation_step."""

    def validation_step(self, batch, batch_idx) -> None:
        super().validation_step(batch, batch_idx)


def test_a_sweep_that_classes_of_ones_own_cannot_run_is_named_before_the_fit():
    """train.py's end-of-fit sweep failed after the whole fit with a traceback: a validation_step
    without dataloader_idx, a datamodule without evaluate_at or longest_side."""
    net = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=9)
    model = NaViTClassifier(net, num_classes=3, optimizer=torch.optim.SGD)
    packed = SimpleNamespace(evaluate_at=None, longest_side=None)  # what the sweep asks of it
    assert why_no_budget_sweep(model, packed) is None
    assert "SimpleNamespace has no evaluate_at or longest_side" in why_no_budget_sweep(
        model, SimpleNamespace()
    )
    own = OneLoaderValidation(net, num_classes=3, optimizer=torch.optim.SGD)
    assert "OneLoaderValidation.validation_step takes no dataloader_idx" in why_no_budget_sweep(own, packed)
