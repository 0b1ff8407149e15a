"""The classifier around NaViT: a head over the real images only, and filler batches."""

import logging
import math
import pickle
import warnings
from functools import partial
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassConfusionMatrix

from navit_lightning.batch import PAD_ID, PackedBatch, PackedShape, image_index
from navit_lightning.data.datamodule import PackedImageDataModule
from navit_lightning.data.packing import pack
from navit_lightning.errors import ConfigError
from navit_lightning.lit_module import (
    MAX_CONFUSION_CLASSES,
    BatchCounts,
    ConfusionCounts,
    HighestValue,
    ImageMean,
    NaViTClassifier,
    ResumePoint,
    image_loss,
    parameter_groups,
)
from navit_lightning.models import NaViT
from navit_lightning.models.heads import BatchNormMlp
from navit_lightning.utils.schedules import warmup_cosine
from tests.conftest import TINY_SET, bare_trainer
from tests.test_datamodule import shapes_datamodule
from tests.test_model import SHAPE
from tests.test_packing import PATCH_DIM, make_sample

GRIDS = [(3, 5), (2, 2), (6, 4), (1, 7), (4, 4), (5, 1), (2, 6), (3, 3), (2, 5), (4, 2)]


def make_batch(rows: int = 4, images: int = len(GRIDS)) -> PackedBatch:
    samples = [make_sample(h, w, label=i % 3, seed=i) for i, (h, w) in enumerate(GRIDS[:images])]
    return pack(samples, PackedShape(rows, 40, 4), PATCH_DIM)


def make_model(head: str, attention: str = "auto") -> NaViTClassifier:
    torch.manual_seed(0)
    net = NaViT(patch_size=4, dim=32, depth=2, heads=4, max_grid=8, attention=attention)
    return NaViTClassifier(net, num_classes=3, optimizer=partial(torch.optim.SGD, lr=0.1), head=head)


@pytest.mark.parametrize("images", [len(GRIDS), 3, 0])
def test_image_index_from_a_host_count_is_the_boolean_mask_order(images):
    """The step selects the images by an index from the count taken on the host (no device
    sync): the same images in the same order as the slots' mask."""
    batch = make_batch(images=images) if images else pack([], SHAPE, PATCH_DIM)
    index = image_index(batch, batch.num_images)
    torch.testing.assert_close(index, image_index(batch))
    torch.testing.assert_close(batch.labels.flatten()[index], batch.labels[batch.image_slots])
    model = make_model("linear").eval()
    torch.testing.assert_close(model(batch, index), model.head(model.net(batch)[batch.image_slots]))


def test_coordinates_past_the_table_are_refused_on_the_host_before_the_copy():
    model = make_model("linear")
    model.net.pos_embed.max_grid = 4  # the batch has images 7 patches long
    with pytest.raises(ValueError, match=r"or train with a larger model\.net\.max_grid"):
        model.on_before_batch_transfer(make_batch(), 0)


def test_a_fit_with_an_image_past_the_position_tables_is_refused_before_its_first_step(project_root):
    """It stopped at the batch that held the image, hours in maybe, and its resume there."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    datamodule.setup("fit")
    longest = max(datamodule.longest_side(split)[0] for split in ("train", "val"))
    net = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=longest - 1)
    model = NaViTClassifier(
        net, num_classes=datamodule.num_classes, optimizer=partial(torch.optim.SGD, lr=0.1)
    )
    trainer = one_step_trainer(accumulate_grad_batches=1)
    with pytest.raises(
        ConfigError,
        match=rf"(train|val) image /\S+\.jpg is {longest} patches long but .+max_grid={longest - 1}:",
    ):
        trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 0


def test_a_row_of_another_layout_is_refused_on_the_host():
    """Padding first, as a packer of one's own might lay a row out: the CPU's default backend
    (segments) gave other features, silently; called by hand too (load_from_checkpoint)."""
    batch = make_batch()
    padded = int((batch.image_ids == PAD_ID).any(1).nonzero()[0])
    image_ids = batch.image_ids.clone()
    image_ids[padded] = image_ids[padded].roll(1)
    rolled = batch._replace(image_ids=image_ids)
    with pytest.raises(
        ValueError,
        match=rf"row {padded}: a row must hold slot 0's tokens, slot 1's, \.\.\., then its padding",
    ):
        make_model("linear").on_before_batch_transfer(rolled, 0)
    with pytest.raises(ValueError, match=rf"row {padded}: a row must hold slot 0's tokens"):
        make_model("linear", attention="segments")(rolled)


def test_pixels_that_are_not_uint8_are_refused():
    """Floats of 0..1, as a hand-made batch might hold them, read as a near-black image."""
    batch = make_batch()
    scaled = batch._replace(patches=batch.patches.float() / 255)
    with pytest.raises(ValueError, match=r"PackedBatch.patches is torch.float32: NaViT reads uint8 pixels"):
        make_model("linear")(scaled)


def test_weight_decay_spares_vectors_the_position_tables_and_the_pooling_query():
    model = make_model("linear")
    decayed, kept = parameter_groups(model)
    names = {id(p): name for name, p in model.named_parameters()}
    assert kept["weight_decay"] == 0.0 and "weight_decay" not in decayed
    assert {"net.pos_embed.y", "net.pos_embed.x", "net.pool.query", "head.1.bias"} <= {
        names[id(p)] for p in kept["params"]
    }
    assert {names[id(p)] for p in decayed["params"]} == {
        name for name, p in model.named_parameters() if name.endswith(".weight") and p.ndim == 2
    }


def test_the_best_val_accuracy_carries_over_a_resume():
    """Its metric state is not in the state_dict: a resumed run took the best since the
    resume for val/acc_best (and for hp/val_acc and a sweep's objective)."""
    model = make_model("linear")
    model.val_acc_best(torch.tensor(0.9))
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    resumed = make_model("linear")
    resumed.on_load_checkpoint(checkpoint)
    resumed.val_acc_best(torch.tensor(0.5))
    assert resumed.val_acc_best.compute().item() == pytest.approx(0.9)


def test_a_resume_takes_the_commands_optimizer_settings_and_keeps_its_rates(caplog):
    """Lightning loads the saved optimizer's settings over the configured ones: a resume with
    optimizer.weight_decay=0.5 trained on at 0.05 without a word."""
    trained = make_model("linear")
    trained.optimizer_factory = partial(torch.optim.AdamW, lr=5e-4, weight_decay=0.05)
    checkpoint = {
        "optimizer_states": [trained.optimizer_factory(params=parameter_groups(trained)).state_dict()]
    }
    resumed = make_model("linear")
    resumed.optimizer_factory = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.5, betas=[0.5, 0.9])
    resumed.trainer = bare_trainer()
    caplog.clear()
    resumed.on_load_checkpoint(checkpoint)  # a test of a checkpoint: nothing trains, nothing said
    assert "optimizer settings" not in caplog.text
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["weight_decay"] == 0.05
    resumed.trainer.state.fn = TrainerFn.FITTING
    resumed.on_load_checkpoint(checkpoint)
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert [(g["weight_decay"], g["betas"], g["lr"]) for g in groups] == [
        (0.5, (0.5, 0.9), 5e-4),
        (0.0, (0.5, 0.9), 5e-4),
    ]
    assert "optimizer settings: betas (0.9, 0.999) -> (0.5, 0.9), weight_decay 0.05 -> 0.5\n" in caplog.text
    caplog.clear()
    resumed.on_load_checkpoint(checkpoint)  # the same settings again: nothing to say
    assert "optimizer settings" not in caplog.text


def test_a_resumes_optimizer_of_another_layout_or_without_a_setting_is_left_to_lightning():
    """Another number of groups is Lightning's load to explain; a setting the checkpoint's
    optimizer lacks (another optimizer, another torch) is not added, nor does it raise."""
    model = make_model("linear")
    model.optimizer_factory = partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.5)
    (one_group,) = torch.optim.AdamW(model.parameters(), weight_decay=0.05).state_dict()["param_groups"]
    model._take_optimizer_settings([one_group])
    assert one_group["weight_decay"] == 0.05
    saved = torch.optim.AdamW(parameter_groups(model), weight_decay=0.05).state_dict()["param_groups"]
    for group in saved:
        del group["foreach"]
    model._take_optimizer_settings(saved)
    assert [group["weight_decay"] for group in saved] == [0.5, 0.0]
    assert not any("foreach" in group for group in saved)


def test_batchnorm_head_counts_only_the_real_images():
    model = make_model("bn_mlp").train()
    batch = make_batch()
    linear, norm = model.head[0], model.head[1]
    features = model.net(batch)
    expected_mean = linear(features[batch.image_slots]).mean(0)
    model(batch)
    momentum = norm.momentum
    torch.testing.assert_close(norm.running_mean, momentum * expected_mean.detach(), atol=1e-6, rtol=0)


def test_batchnorm_head_trains_on_a_batch_of_one_image_with_its_running_statistics():
    """An epoch's last batch can hold one image, which has no batch statistics: BatchNorm
    raised, and a resumed run raised again at the same batch of the same plan."""
    model = make_model("bn_mlp").train()
    norm = model.head[1]
    norm.running_mean.uniform_(-1, 1)
    norm.running_var.uniform_(0.5, 2)
    running = (norm.running_mean.clone(), norm.running_var.clone())
    batch = make_batch(images=1)
    with pytest.warns(UserWarning, match="self.log"):  # no Trainer here to log to
        model.training_step(batch, 0).backward()
    torch.testing.assert_close((norm.running_mean, norm.running_var), running)
    assert norm.weight.grad is not None and norm.weight.grad.any()
    # the same output as in evaluation, where the running statistics normalise every image
    logits = model(batch)
    torch.testing.assert_close(logits, model.eval()(batch))


@pytest.mark.parametrize("head", ["linear", "bn_mlp"])
@pytest.mark.parametrize("attention", ["sdpa", "segments"])
def test_an_all_padding_filler_batch_gives_zero_loss_and_a_gradient_to_every_parameter(head, attention):
    """A rank one batch short trains on a filler batch. Under DDP every parameter must get a
    gradient in its backward (zero here), or that rank skips an all_reduce that the other
    ranks enter and the run hangs (it did, with segments, at 14 rows of the tiny data)."""
    model = make_model(head, attention).train()
    with pytest.warns(UserWarning, match="self.log"):  # no Trainer here to log to
        loss = model.training_step(pack([], SHAPE, PATCH_DIM), 0)
    loss.backward()
    assert loss.item() == 0
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters())
    assert all(torch.isfinite(b).all() for b in model.buffers())


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What image_loss should be, from torch's own mean: 0 for a batch without images."""
    return F.cross_entropy(logits, labels) if len(labels) else logits.new_zeros(())


def test_the_loss_is_the_mean_cross_entropy_over_the_real_images():
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    torch.testing.assert_close(image_loss(logits, labels), mean_cross_entropy(logits, labels))
    assert image_loss(logits[:0], labels[:0]).item() == 0


def weighted_mean(losses: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    return sum(loss * weight for loss, weight in losses) / sum(weight for _, weight in losses)


@torch.no_grad()
def test_the_epoch_loss_and_accuracy_are_means_over_the_images_of_every_rank():
    """Lightning's epoch mean of a logged loss tensor averages each rank's mean of its batch
    means, a filler batch counted as one image of loss 0. The logged ImageMean metrics sum
    the images' losses and correct predictions and count the images, on each rank and then
    across ranks (merge_state reduces the states as the sync does). A rank given only filler
    batches updates its metrics too: torchmetrics would warn that compute() came first."""
    filler = pack([], SHAPE, PATCH_DIM)
    rank_batches = [[make_batch(images=10), make_batch(images=3)], [make_batch(images=6), filler], [filler]]
    ranks = [make_model("linear").eval() for _ in rank_batches]
    rank_losses = []  # each rank's (batch loss, images)
    correct = 0
    for model, batches in zip(ranks, rank_batches, strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no Trainer here to log to
            for index, batch in enumerate(batches):
                model.validation_step(batch, index)
        logits = [model(b) for b in batches]
        labels = [b.labels[b.image_slots] for b in batches]
        losses = [mean_cross_entropy(*pair) for pair in zip(logits, labels, strict=True)]
        rank_losses.append(list(zip(losses, [b.num_images for b in batches], strict=True)))
        correct += sum(int((x.argmax(-1) == y).sum()) for x, y in zip(logits, labels, strict=True))
    per_image = weighted_mean([pair for losses in rank_losses for pair in losses])
    lightning_mean = (
        sum(weighted_mean([(loss, max(n, 1)) for loss, n in losses]) for losses in rank_losses) / 3
    )
    assert abs(lightning_mean - per_image) > 0.01  # the case under test: they differ

    for name, expected in (("val_loss", per_image), ("val_acc", torch.tensor(correct / 19))):
        mean = ranks[0].metrics[name]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # the filler-only rank's own value: no image, a mean of 0 (not 0 / 0)
            assert ranks[2].metrics[name].compute().item() == 0
        for rank in ranks[1:]:
            mean.merge_state(rank.metrics[name])
        torch.testing.assert_close(mean.compute(), expected, atol=1e-6, rtol=0, msg=name)


def test_the_model_flops_are_the_last_training_batchs():
    """Counted on the host for the training batches only: an evaluation's batches count none."""
    model, training, evaluation = make_model("linear"), make_batch(), make_batch(images=3)
    model.trainer = SimpleNamespace(training=True)
    model.on_before_batch_transfer(training, 0)
    assert model.flops_per_batch == int(model.net.train_flops(training)) > 0
    model.trainer = SimpleNamespace(training=False)
    model.on_before_batch_transfer(evaluation, 0)
    assert model.flops_per_batch == int(model.net.train_flops(training))


def test_throughput_monitor_logs_tokens_and_model_flops(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from navit_lightning.utils.callbacks import PackedThroughputMonitor

    model, batch = make_model("linear"), make_batch()
    monitor = PackedThroughputMonitor(window_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        log_every_n_steps=1,
        callbacks=[monitor],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # first a batch whose every image failed to decode: fewer images than batches, which
    # Lightning's Throughput refused
    trainer.fit(
        model,
        DataLoader([make_batch(images=0)] + [batch] * 4, batch_size=None),
        DataLoader([batch] * 2, batch_size=None),
    )
    assert model.flops_per_batch == int(model.net.train_flops(batch)) > 0
    header, *rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    columns = header.split(",")
    logged = {
        name: [row.split(",")[i] for row in rows if row.split(",")[i]] for i, name in enumerate(columns)
    }
    assert logged["train/device/flops_per_sec"] and float(logged["train/device/flops_per_sec"][-1]) > 0
    assert logged["train/device/items_per_sec"] and logged["train/device/samples_per_sec"]
    # samples are images and items real tokens, both counted on the host
    samples, items = (float(logged[f"train/device/{name}_per_sec"][-1]) for name in ("samples", "items"))
    assert samples / items == pytest.approx(batch.num_images / batch.num_real_tokens)
    # an evaluation's figures were logged at its own batch numbers, from 1 at every validation
    assert not [name for name in columns if name.startswith(("validate/", "test/"))]


def validation_trainer(fn: TrainerFn = TrainerFn.FITTING, sanity_checking: bool = False) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(fn=fn), sanity_checking=sanity_checking)


@torch.no_grad()
def test_the_confusion_matrix_counts_the_images_of_the_first_validation_loader_only(monkeypatch):
    """The other loaders of a budget sweep see the same images again at other sizes."""
    model, batch = make_model("linear").eval(), make_batch()
    monkeypatch.setattr(model, "log", lambda *_, **__: None)
    model.validation_step(batch, 0, dataloader_idx=1)
    assert model.val_confusion.counts.sum() == 0
    model.validation_step(batch, 0, dataloader_idx=0)
    assert model.val_confusion.counts.sum() == batch.num_images


def test_the_confusion_counts_are_torchmetrics_confusion_matrix_in_deterministic_mode_too(caplog):
    """MulticlassConfusionMatrix counted through an (images, classes^2) comparison under
    torch's deterministic mode, trainer.deterministic's default: 4.2 GB at 1,000 classes."""
    generator = torch.Generator().manual_seed(0)
    logits, labels = (
        torch.randn(500, 7, generator=generator),
        torch.randint(0, 7, (500,), generator=generator),
    )
    counts = ConfusionCounts(7)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for part in range(0, 500, 128):  # batches, the last one short
            counts.update(logits[part : part + 128], labels[part : part + 128])
    finally:
        torch.use_deterministic_algorithms(deterministic)
    expected = MulticlassConfusionMatrix(7)(logits.argmax(-1), labels)
    assert torch.equal(counts.compute(), expected) and counts.compute().sum() == 500
    with caplog.at_level(logging.INFO):
        many = NaViTClassifier(
            make_model("linear").net, num_classes=MAX_CONFUSION_CLASSES + 1, optimizer=torch.optim.SGD
        )
    assert (
        many.val_confusion is None
        and "1001 classes: no confusion matrix of the validation images" in caplog.text
    )


@torch.no_grad()
def test_only_fits_validations_past_the_sanity_check_make_the_best_accuracy_and_the_confusion_matrix(
    monkeypatch,
):
    model, batch = make_model("linear").eval(), make_batch()
    monkeypatch.setattr(model, "log", lambda *_, **__: None)

    def validate(trainer: SimpleNamespace) -> None:
        model.trainer = trainer
        model.metrics["val_acc"].reset()
        model.validation_step(batch, 0)
        model.on_validation_epoch_end()

    validate(validation_trainer(sanity_checking=True))
    validate(validation_trainer(TrainerFn.VALIDATING))  # eval.py on the val split
    assert model.val_acc_best.max_value.item() == -math.inf and model.val_confusion_matrix is None
    for _ in range(2):  # each validation's confusion matrix counts its own images only
        validate(validation_trainer())
        assert model.val_acc_best.max_value == model.metrics["val_acc"].compute()
        assert model.val_confusion_matrix.sum() == batch.num_images


def test_each_stage_starts_its_metrics_from_nothing_and_only_fit_compiles(monkeypatch):
    model, batch = make_model("linear"), make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Trainer here to log to
        model.validation_step(batch, 0)
    model.trainer = bare_trainer()  # without a datamodule
    model.setup("validate")
    assert model.metrics["val_loss"].images.item() == 0 and model.val_confusion.counts.sum() == 0
    compiled: list[bool] = []
    monkeypatch.setattr(model.net, "compile", lambda: compiled.append(True))
    model.compile = True
    model.setup("validate")
    assert not compiled
    model.setup("fit")
    assert compiled == [True]


def test_the_monitorable_metrics_are_those_a_fit_leaves_for_the_callbacks():
    """What train.py lets callbacks.*.monitor name, against what a fit with validation logs."""
    model, loader = make_model("linear"), DataLoader([make_batch()], batch_size=None)
    trainer = bare_trainer(max_epochs=1, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(model, loader, loader)
    assert set(trainer.callback_metrics) == model.monitorable_metrics()


def one_step_trainer(accumulate_grad_batches: int) -> L.Trainer:
    """One optimizer step over `accumulate_grad_batches` batches, without validation."""
    return bare_trainer(max_steps=1, accumulate_grad_batches=accumulate_grad_batches, limit_val_batches=0)


class MeanOfMeans(NaViTClassifier):
    """A subclass's own training_step, returning its batch's mean loss as Lightning's docs do."""

    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")


def test_the_callbacks_get_the_batch_counts_whatever_the_step():
    """A subclass's own training_step left them at the sanity check's last batch: throughput
    figures stale, and an epoch of readable images stopped as 'none could be decoded'."""
    model, batch = make_model("linear"), make_batch(images=5)
    model.trainer = SimpleNamespace(training=True)
    model.on_before_batch_transfer(batch, 0)
    assert model.batch_counts == BatchCounts(5, batch.num_real_tokens, batch.image_ids.numel())


@pytest.mark.parametrize("own_step", [False, True])
def test_accumulated_batches_make_one_mean_over_the_steps_images(project_root, own_step):
    """Two accumulated batches of unequal image counts: each SGD step moves the weights by the
    gradient of the mean loss over its images, not by the mean of the two batch means; the
    second step counts its own images only. A subclass's own step returning a mean trains as
    Lightning trains it (its gradients were scaled by the batches of a step, 2x here)."""
    torch.manual_seed(0)
    net = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=64)
    model = (MeanOfMeans if own_step else NaViTClassifier)(
        net, num_classes=6, optimizer=partial(torch.optim.SGD, lr=1.0)
    )
    reference = pickle.loads(pickle.dumps(model))

    def small_images() -> PackedImageDataModule:  # several a row, as many as their sizes allow
        root = str(project_root / TINY_SET)
        sizes = dict(max_patches=16, min_patches=4, rows=4, row_len=64)
        return PackedImageDataModule(root, patch_size=16, num_workers=0, **sizes)

    datamodule = small_images()
    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())[:4]  # epoch 0's, as the fit's
    for step in (batches[:2], batches[2:]):
        assert step[0].num_images != step[1].num_images  # else both means are the same
        reference.zero_grad()
        means = [mean_cross_entropy(reference(b), b.labels[b.image_slots]) for b in step]
        if own_step:
            (sum(means) / len(step)).backward()
        else:
            images = [b.num_images for b in step]
            (sum(m * n for m, n in zip(means, images, strict=True)) / sum(images)).backward()
        with torch.no_grad():
            torch._foreach_sub_(list(reference.parameters()), [p.grad for p in reference.parameters()])

    trainer = bare_trainer(max_steps=2, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(model, datamodule=small_images())
    for (name, moved), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(moved, expected, atol=1e-6, rtol=1e-4, msg=name)


def test_at_two_ranks_a_step_moves_by_the_mean_gradient_over_every_ranks_images(monkeypatch):
    """This rank's batch of 7 images gives its summed loss; DDP then averages the 2 ranks'
    summed gradients, which the hook scales by 2 / (7 + the other rank's 5) images."""
    model, batch = make_model("linear"), make_batch(images=7)
    other_rank = 5
    strategy = SimpleNamespace(reduce=lambda tensor, reduce_op: tensor + other_rank)
    model.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=1, strategy=strategy)
    monkeypatch.setattr(model, "log", lambda *_, **__: None)
    loss = model.training_step(batch, 0)
    torch.testing.assert_close(loss, mean_cross_entropy(model(batch), batch.labels[batch.image_slots]) * 7)
    loss.backward()
    summed = [p.grad.clone() for p in model.parameters()]
    model.on_before_optimizer_step(None)
    for parameter, gradient in zip(model.parameters(), summed, strict=True):
        torch.testing.assert_close(parameter.grad, gradient * 2 / (7 + other_rank))
    assert model._step_images == 0


@pytest.mark.parametrize(("rule", "exponent"), [("sqrt", 0.5), ("linear", 1.0), (None, 0.0)])
def test_lr_scaling_carries_the_rate_to_the_effective_batch_before_the_schedule(project_root, rule, exponent):
    """4 accumulated batches of 4 rows x 64 tokens: 1024 tokens a step, 8x the reference."""
    datamodule = shapes_datamodule(project_root, num_workers=0)
    net = NaViT(patch_size=16, dim=32, depth=1, heads=2, max_grid=64)
    model = NaViTClassifier(
        net,
        num_classes=datamodule.num_classes,
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        scheduler=warmup_cosine,
        lr_scaling=rule,
        lr_reference_tokens=128,
    )
    trainer = one_step_trainer(accumulate_grad_batches=4)
    trainer.fit(model, datamodule=datamodule)
    assert datamodule.step_tokens() == 1024
    # the schedule's base rate, which it warms up to and decays from
    assert [group["initial_lr"] for group in trainer.optimizers[0].param_groups] == pytest.approx(
        [1e-3 * 8**exponent] * 2
    )


def test_the_ema_update_lerps_floats_copies_counts_and_pickles():
    from navit_lightning.utils.callbacks import EMAWeights, ema_update

    averages = [torch.zeros(3), torch.ones(2, dtype=torch.float64)]
    ema_update(0.25, averages, [torch.full((3,), 4.0), torch.full((2,), 3.0, dtype=torch.float64)], None)
    assert torch.equal(averages[0], torch.full((3,), 1.0))  # 0 + 0.25 * (4 - 0)
    assert torch.equal(averages[1], torch.full((2,), 1.5, dtype=torch.float64))
    counts = [torch.tensor(7)]
    ema_update(0.25, counts, [torch.tensor(12)], None)
    assert counts[0].item() == 12
    # bf16-true and 64-true convert the model after WeightAveraging copied it: the average
    # stays float32 (it failed at the first step)
    for dtype in (torch.bfloat16, torch.float64):
        kept = [torch.zeros(3)]
        ema_update(0.25, kept, [torch.full((3,), 4.0, dtype=dtype)], None)
        assert kept[0].dtype == torch.float32 and torch.equal(kept[0], torch.full((3,), 1.0))
    restored = pickle.loads(pickle.dumps(EMAWeights(decay=0.9)))  # ddp_spawn sends it to the ranks
    assert restored._kwargs["multi_avg_fn"].args == (pytest.approx(0.1),)
    with pytest.raises(ConfigError, match=r"callbacks.ema.decay=1 must be in \[0, 1\)"):
        EMAWeights(decay=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_validation_on_the_ema_average_leaves_both_weights_as_they_were(dtype):
    """The average keeps float32 under 64-true and bf16-true: Lightning's swap through each
    other's tensors rounded the trained weights (64-true) or the average (bf16-true) at every
    validation."""
    from navit_lightning.utils.callbacks import EMAWeights

    model = torch.nn.Linear(3, 2).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1 / 3, 2 / 3, 1 / 7], [3 / 7, 5 / 9, 1 / 11]], dtype=dtype))
    averaged = torch.nn.Linear(3, 2)
    with torch.no_grad():
        averaged.weight.fill_(1 / 3)
    ema = EMAWeights()
    ema._average_model = SimpleNamespace(module=averaged)
    trained, average = model.weight.detach().clone(), averaged.weight.detach().clone()
    ema._swap_models(model)  # into the validation
    assert torch.equal(model.weight, average.to(dtype))
    ema._swap_models(model)  # back
    assert torch.equal(model.weight, trained) and torch.equal(averaged.weight, average)


def test_epoch_metrics_keep_32_bits_under_bf16_true():
    """Lightning's bf16-true calls .to(torch.bfloat16) on the module, metric states too: the
    image count stopped at 256 (val/acc 0.941 for 0.975 on 1,000 images)."""
    mean = ImageMean().to(dtype=torch.bfloat16)
    for number in range(1000):
        mean.update(torch.tensor(float(number % 2)), 1)
    assert mean.compute().item() == 0.5 and mean.images.item() == 1000
    best = HighestValue().to(dtype=torch.bfloat16)
    best.update(torch.tensor(0.975))
    assert best.compute().item() == pytest.approx(0.975, abs=1e-7)


@torch.no_grad()
def test_predict_step_gives_each_images_number_and_class_probabilities():
    """predict.py writes these as each image's class probabilities: logits there summed to
    anything and went below 0."""
    model, batch = make_model("linear").eval(), make_batch()
    numbers, probabilities = model.predict_step(batch, 0)
    assert numbers.tolist() == batch.labels[batch.image_slots].tolist()
    assert probabilities.shape == (batch.num_images, 3)
    assert ((probabilities >= 0) & (probabilities <= 1)).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(batch.num_images))
    torch.testing.assert_close(probabilities, model(batch).softmax(-1))


def test_a_training_step_logs_its_batchs_images_and_fill(monkeypatch):
    """train/images_per_batch is the batch's image count and train/fill its real tokens'
    share of its slots: swapped, each read as the other."""
    model, batch = make_model("linear"), make_batch(images=7)
    logged: dict[str, Any] = {}
    monkeypatch.setattr(model, "log", lambda name, value, **_: logged.setdefault(name, value))
    model.training_step(batch, 0)
    assert batch.num_images == 7 and batch.num_real_tokens < batch.image_ids.numel()
    assert logged["train/images_per_batch"].item() == 7
    assert logged["train/fill"].item() == pytest.approx(batch.num_real_tokens / batch.image_ids.numel())


def test_a_checkpoints_resume_point_is_its_training_loaders_position():
    position = {"epoch": 1, "batches_done": 3, "batches_per_rank": 8, "ranks": 2, "plan": "0" * 64}
    checkpoint = {"global_step": 11, "loops": {"fit_loop": {"state_dict": {"combined_loader": [position]}}}}
    assert ResumePoint.of(checkpoint) == ResumePoint(11, 1, 3, 8)
    assert ResumePoint.of({"global_step": 11, "loops": {}}) is None  # no loader position saved


def test_a_resumed_epoch_has_no_more_batches_left_than_this_run_gives_it():
    """Resumed 5 batches into an epoch planned at 8 a rank, where this run's epoch has 4 (on
    twice the ranks): nothing of it is left, not the 3 the old plan had still to go."""
    assert ResumePoint(5, 0, 5, 8).batches_left(4) == 0
    assert ResumePoint(5, 0, 5, 8).batches_left(10) == 3  # the old plan's 8 bound it
    assert ResumePoint(2, 0, 2, 8).batches_left(4) == 2


def schedule_model(resumed: ResumePoint | None, **trainer: Any) -> NaViTClassifier:
    """A model resumed at `resumed` under a stand-in Trainer with `trainer`'s settings."""
    model = make_model("linear")
    settings = dict(estimated_stepping_batches=30, max_epochs=3, max_steps=-1, accumulate_grad_batches=1)
    settings["datamodule"] = None
    model.trainer = SimpleNamespace(**{**settings, "num_training_batches": 10, **trainer})
    model._resumed_at = resumed
    return model


def test_a_resumed_runs_schedule_is_its_steps_made_and_to_come_capped_at_max_steps():
    """Resumed at step 10, the end of epoch 0 of 3 at 10 batches an epoch: 20 steps to come.
    trainer.max_steps=12 ends the run at step 12, where the cosine must end too: at 30 it
    stopped a third of the way down."""
    at_epoch_end = ResumePoint(10, 0, 10, 10)
    assert schedule_model(at_epoch_end)._schedule_length() == 30
    assert schedule_model(at_epoch_end, max_steps=12)._schedule_length() == 12
    assert schedule_model(at_epoch_end, max_steps=50)._schedule_length() == 30
    # a fresh run, or one of unknown length: Lightning's estimate
    assert schedule_model(None, estimated_stepping_batches=12, max_steps=12)._schedule_length() == 12
    unbounded = schedule_model(at_epoch_end, max_epochs=-1, estimated_stepping_batches=math.inf)
    assert unbounded._schedule_length() == math.inf
    # epochs without end, to trainer.max_steps: Lightning's estimate, that step
    endless = schedule_model(at_epoch_end, max_epochs=-1, max_steps=40, estimated_stepping_batches=40)
    assert endless._schedule_length() == 40


def test_a_resumed_runs_schedule_counts_an_epochs_last_accumulation_window_as_a_step():
    """10 batches an epoch at 3 a step are 4 steps (Lightning steps on the epoch's last batch):
    resumed at step 1 (3 batches done) of epoch 0 of 3, 3 + 4 + 4 steps to come."""
    mid_epoch = ResumePoint(1, 0, 3, 10)
    assert schedule_model(mid_epoch, accumulate_grad_batches=3)._schedule_length() == 12


def test_a_resume_keeps_its_runs_schedule_length_unless_what_it_follows_changed():
    """Lightning's estimate counts the batches of the epoch the loader is at (each is packed
    anew): the run's own length, saved, holds while the settings it follows are the same."""

    def configured(checkpoint: dict | None, **trainer: Any) -> NaViTClassifier:
        model = make_model("linear")
        model.scheduler_factory = lambda optimizer, steps: torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda _: 1.0
        )
        settings = dict(
            max_epochs=3,
            max_steps=-1,
            accumulate_grad_batches=1,
            world_size=1,
            limit_train_batches=1.0,
            datamodule=None,
            estimated_stepping_batches=30,
            state=SimpleNamespace(fn=TrainerFn.FITTING),
        )
        model.trainer = SimpleNamespace(**{**settings, **trainer})
        if checkpoint is not None:
            model.on_load_checkpoint(checkpoint)
        model.configure_optimizers()
        return model

    checkpoint: dict = {"global_step": 10}
    configured(None, estimated_stepping_batches=42).on_save_checkpoint(checkpoint)
    assert checkpoint["schedule"]["steps"] == 42
    assert configured(checkpoint)._schedule["steps"] == 42
    assert configured(checkpoint, world_size=2)._schedule["steps"] == 30


def test_a_synced_batchnorm_head_in_a_world_of_one_rank_trains_on_one_image(tmp_path):
    """ddp on one device with trainer.sync_batchnorm=true: SyncBatchNorm gathers nothing in a
    world of one, so a batch of one image takes the running statistics as without it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        head = torch.nn.SyncBatchNorm.convert_sync_batchnorm(BatchNormMlp(8, 3)).train()
        logits = head(torch.randn(1, 8))
    finally:
        dist.destroy_process_group()
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()


class OneImageOverTheRanks(torch.nn.BatchNorm1d):
    """What CUDA's SyncBatchNorm does with one image over every rank: that image's mean, and
    its unbiased variance 0/0 into running_var."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running_var.fill_(float("nan"))
        return x * self.weight + self.bias


def test_a_synced_batchnorm_head_keeps_its_running_variance_over_one_image_of_all_ranks(monkeypatch):
    """The epoch's last step, one image on one rank and filler on the others: every later
    evaluation (val/acc, the best checkpoint, eval.py) ran on a NaN running_var, silently."""
    monkeypatch.setattr("navit_lightning.models.heads.gathers_across_ranks", lambda norm: True)
    head = BatchNormMlp(8, 3).train()
    head[1] = OneImageOverTheRanks(8)
    head[1].running_var.uniform_(0.5, 2.0)
    before = head[1].running_var.clone()
    assert torch.isfinite(head(torch.randn(1, 8))).all()
    assert torch.equal(head[1].running_var, before)


def test_a_stop_inside_a_fit_validation_leaves_the_trained_weights_in_the_model():
    """The average is swapped in for a validation: an error or Ctrl-C there would leave it in
    the model, and the save on the stop would write it as the trained weights."""
    from navit_lightning.utils.callbacks import EMAWeights

    class StopInValidation(L.Callback):  # before EMAWeights: it sees the trained weights
        def on_validation_epoch_start(self, trainer, pl_module) -> None:
            self.trained = {name: value.clone() for name, value in pl_module.state_dict().items()}

        def on_validation_batch_end(self, *args: Any) -> None:
            raise RuntimeError("stopped in a validation")

    model, loader = make_model("linear"), DataLoader([make_batch()] * 3, batch_size=None)
    stop, ema = StopInValidation(), EMAWeights(decay=0.5)
    trainer = bare_trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[stop, ema])
    with pytest.raises(RuntimeError, match="stopped in a validation"):
        trainer.fit(model, loader, loader)
    average = ema._average_model.module.state_dict()
    assert not all(torch.equal(average[name], value) for name, value in stop.trained.items())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, stop.trained[name], atol=0, rtol=0, msg=name)
    assert not ema.average_in_model


def test_the_average_takes_the_trained_weights_from_a_checkpoint_in_fit_only():
    """After fit, train.py tests the best checkpoint: its state_dict (the average), which
    eval.py tests too, not the trained weights saved beside it for a resume."""
    from unittest.mock import MagicMock

    from navit_lightning.utils.callbacks import EMAWeights

    checkpoint = {"state_dict": {}, "current_model_state": {"w": 1}, "averaging_state": {}}
    for fn, loaded in ((TrainerFn.TESTING, False), (TrainerFn.FITTING, True)):
        ema, module = EMAWeights(), MagicMock()
        ema._average_model = MagicMock()  # as its setup in a fit made it
        ema.on_load_checkpoint(SimpleNamespace(state=SimpleNamespace(fn=fn)), module, checkpoint)
        assert module.load_state_dict.called is loaded, fn


def test_the_rank_step_report_gives_each_ranks_batch_count_in_its_own_place(monkeypatch):
    from navit_lightning.utils import callbacks

    reported = []
    monkeypatch.setattr(callbacks, "rank_zero_info", reported.append)
    report = callbacks.RankStepReport()
    summed = SimpleNamespace(reduce=lambda counts, reduce_op: counts)  # the other ranks' counts: 0
    trainer = SimpleNamespace(world_size=3, global_rank=1, strategy=summed)
    module = SimpleNamespace(device=torch.device("cpu"))
    for batches in (4, 2):  # a second fit of the same trainer reports its own
        report.on_train_start(trainer, module)
        for _ in range(batches):
            report.on_train_batch_end(trainer)
        report.on_train_end(trainer, module)
    assert reported == [f"training batches per rank: [0, {n}, 0] (world size 3)" for n in (4, 2)]
