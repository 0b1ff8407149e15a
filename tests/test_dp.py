"""strategy=dp: rows split over replicas, features gathered, loss and metrics once.

Without GPUs the strategy runs its CPU stand-in: the same split, threads and gather, with
every share run by the one module instead of a replica per GPU."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from navit_lightning.batch import PackedBatch
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.lit_module import NaViTClassifier
from navit_lightning.strategies import PackedDataParallelStrategy
from navit_lightning.strategies.dp import apply_replicas, split_rows
from tests.test_lit_module import make_batch, make_model


class RecordStep(L.Callback):
    """The gradients of the first optimizer step and the rows of every network call."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.net_rows: list[int] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.net.register_forward_pre_hook(lambda _, args: self.net_rows.append(len(args[0].patches)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {name: p.grad.clone() for name, p in pl_module.named_parameters() if p.grad is not None}


def dp_trainer(**options) -> L.Trainer:
    """PackedDataParallelStrategy over two CPU stand-ins for GPUs."""
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PackedDataParallelStrategy(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def fit_one_step(head: str, strategy, devices: int) -> tuple[NaViTClassifier, L.Trainer, RecordStep]:
    model, record = make_model(head), RecordStep()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader([make_batch()], batch_size=None))
    return model, trainer, record


@pytest.mark.parametrize("head", ["linear", "bn_mlp"])
def test_dp_over_two_devices_gives_the_loss_gradients_and_metrics_of_one_forward(head):
    whole_model, whole, whole_record = fit_one_step(head, "auto", devices=1)
    dp_model, dp, dp_record = fit_one_step(head, PackedDataParallelStrategy(), devices=2)

    assert whole_record.net_rows == [4] and dp_record.net_rows == [2, 2]
    for name in ("train/loss", "train/acc", "train/images_per_batch"):
        torch.testing.assert_close(dp.callback_metrics[name], whole.callback_metrics[name], atol=1e-6, rtol=0)
    assert dp_record.grads.keys() == whole_record.grads.keys() and len(dp_record.grads) > 10
    for name, grad in whole_record.grads.items():
        torch.testing.assert_close(dp_record.grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # The metric state lives in the one process: the accuracy over the step's images.
    for state in ("total", "images"):
        assert getattr(dp_model.metrics["train_acc"], state) == getattr(
            whole_model.metrics["train_acc"], state
        )
    # A BatchNorm head normalised over all the batch's images, not over one device's share.
    for (name, buffer), (_, expected) in zip(
        dp_model.named_buffers(), whole_model.named_buffers(), strict=True
    ):
        torch.testing.assert_close(buffer, expected, atol=1e-6, rtol=0, msg=name)


def test_split_rows_gives_every_row_to_one_device_and_fewer_shares_than_devices_if_short():
    batch = make_batch(rows=3, images=6)
    shares = split_rows(batch, [torch.device("cpu")] * 4)
    assert [len(share.patches) for share in shares] == [1, 1, 1]
    for field, parts in zip(batch, zip(*shares, strict=True), strict=True):
        torch.testing.assert_close(torch.cat(parts), field)


def test_replicas_run_under_the_callers_autocast_dtype():
    """Autocast's dtype is thread-local: torch's parallel_apply would drop a bf16 choice."""
    seen = []

    class Probe(nn.Module):
        def forward(self, share: PackedBatch) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return share.labels.float()

    shares = split_rows(make_batch(), [torch.device("cpu")] * 2)
    with torch.autocast("cpu", dtype=torch.float16):
        apply_replicas([Probe(), Probe()], shares, [torch.device("cpu")] * 2)
    assert seen == [(True, torch.float16)] * 2


def test_a_replica_error_reaches_the_caller():
    class Broken(nn.Module):
        def forward(self, share: PackedBatch) -> torch.Tensor:
            raise RuntimeError("replica failed")

    shares = split_rows(make_batch(), [torch.device("cpu")] * 2)
    with pytest.raises(RuntimeError, match="replica failed"):
        apply_replicas([Broken(), Broken()], shares, [torch.device("cpu")] * 2)


def test_a_dp_process_loads_the_rows_of_every_device_it_drives(tmp_path):
    """The datamodule gives a dp process data.rows per device: with one device's rows, each
    of two GPUs got half a batch, and the run trained on half the data.rows it asked for."""
    trainer = dp_trainer()
    assert trainer.strategy.devices_per_process == 2
    datamodule = PackedImageDataModule(str(tmp_path), patch_size=16, max_patches=64, rows=4, row_len=64)
    datamodule.trainer = trainer
    assert datamodule.process_shape().rows == 2 * 4


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_dp_splits_the_rows_over_the_devices_in_evaluation_and_prediction_too(stage):
    """Not in training alone: a validation, test or prediction ran every row on the first device."""
    model = make_model("linear")
    rows: list[int] = []
    model.net.register_forward_pre_hook(lambda _, args: rows.append(len(args[0].patches)))
    getattr(dp_trainer(), stage)(model, DataLoader([make_batch()], batch_size=None))
    assert rows == [2, 2]


def test_replicas_run_under_the_callers_grad_mode():
    """An evaluation's replicas would otherwise keep a graph of every share's activations."""
    seen = []

    class Probe(nn.Module):
        def forward(self, share: PackedBatch) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return share.labels.float()

    shares = split_rows(make_batch(), [torch.device("cpu")] * 2)
    with torch.no_grad():
        apply_replicas([Probe(), Probe()], shares, [torch.device("cpu")] * 2)
    assert seen == [False, False]
    apply_replicas([Probe(), Probe()], shares, [torch.device("cpu")] * 2)
    assert seen == [False, False, True, True]
