"""Settings this machine cannot run are refused before any process starts, with one line."""

import re

import pytest
import torch
from hydra import compose, initialize_config_dir

from navit_lightning import CONFIG_DIR
from navit_lightning.errors import ConfigError
from navit_lightning.eval import evaluate
from navit_lightning.predict import predict
from navit_lightning.utils.validate import check_launch


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize(
    ("gpus", "overrides", "message"),
    [
        (0, ["trainer.accelerator=gpu"], "no CUDA GPU is visible: use trainer.accelerator=cpu"),
        (0, ["trainer.precision=16-mixed"], "on CPU use trainer.precision=bf16-mixed"),
        (
            0,
            ["trainer.sync_batchnorm=true", "strategy=ddp", "trainer.devices=2"],
            "sync_batchnorm=true needs CUDA",
        ),
        (2, ["trainer.devices=4", "strategy=ddp"], "trainer.devices=4 but 2 CUDA GPU(s) are visible"),
        (0, ["trainer.strategy=dp"], "trainer.strategy=dp is unknown: use strategy=<one of auto, ddp"),
        (0, ["strategy=dp"], "strategy=dp drives several CUDA GPUs from one process and none is visible"),
        (2, ["strategy=dp", "trainer.num_nodes=2"], "for trainer.num_nodes>1 use strategy=ddp"),
        (2, ["strategy=dp", "trainer.sync_batchnorm=true"], "drop trainer.sync_batchnorm"),
        (2, ["strategy=dp", "model.compile=true"], "model.compile=true cannot run under strategy=dp"),
        (0, ["model.net.attention=varlen"], "varlen is flash attention on CUDA: on CPU use"),
        (2, ["model.net.attention=varlen"], "needs bf16 or fp16 but trainer.precision=32-true"),
        (0, ["model.net.attention=flex"], "flex cannot train on CPU"),
        (0, ["~logger"], "callbacks.learning_rate_monitor needs a logger: with ~logger add"),
        (0, ["trainer.reload_dataloaders_every_n_epochs=0"], "so it must rebuild it every epoch: keep 1"),
        (0, ["patch_budgets=[16,0]"], "must be a list of positive patch counts, e.g. patch_budgets="),
        (0, ["patch_budgets=36"], "must be a list of positive patch counts"),
        (0, ["model.lr_scaling=square"], "model.lr_scaling='square' is unknown: use one of"),
        (0, ["data=imagefolder"], "data.root must be set: add data.root=/path/to/images to the command"),
        (0, ["data=shards"], "data.root must be set: add data.root=/path/to/images to the command"),
        (
            2,
            ["optimizer.fused=true", "trainer.precision=bf16-mixed"],
            "optimizer.fused=true cannot clip gradients under trainer.precision=bf16-mixed",
        ),
        (
            0,
            ["optimizer.fused=true", "trainer.precision=bf16"],
            "optimizer.fused=true cannot clip gradients under trainer.precision=bf16:",
        ),
    ],
)
def test_refused(monkeypatch, gpus, overrides, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_launch(config(*overrides))


@pytest.mark.parametrize(
    ("task", "overrides", "message"),
    [
        ("eval", [], "ckpt_path must be set: add ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"),
        ("predict", [], "ckpt_path and input must be set: add ckpt_path=logs/train/runs/<run>/checkpoints/"),
        (
            "eval",
            ["ckpt_path=run.ckpt", "split=tset"],
            "split='tset' is unknown: use split=val or split=test",
        ),
    ],
)
def test_eval_and_predict_refuse_what_they_miss(task, overrides, message):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(task, overrides=overrides)
    run = {"eval": evaluate, "predict": predict}[task]
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(cfg)


@pytest.mark.parametrize(
    ("gpus", "overrides"),
    [
        (0, []),
        (0, ["trainer.precision=bf16-mixed", "trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp"]),
        (
            2,
            [
                "trainer.devices=2",
                "strategy=ddp",
                "trainer.sync_batchnorm=true",
                "trainer.precision=16-mixed",
            ],
        ),
        (2, ["strategy=dp", "trainer.devices=2", "trainer.precision=bf16-mixed", "model.head=bn_mlp"]),
        (0, ["trainer.strategy=ddp_spawn", "trainer.accelerator=cpu"]),
        (2, ["model.net.attention=varlen", "trainer.precision=bf16-mixed"]),
        (2, ["model.net.attention=flex"]),
        (0, ["~logger", "callbacks.learning_rate_monitor=null"]),
        (0, ["optimizer.fused=true"]),
        (2, ["optimizer.fused=true", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=null"]),
    ],
)
def test_allowed(monkeypatch, gpus, overrides):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    check_launch(config(*overrides))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.precision=16-mixed"], "trainer.precision=16-mixed needs a CUDA GPU"),
        (["strategy=dp", "trainer.devices=2"], "on CPU use strategy=ddp trainer.accelerator=cpu"),
        (["trainer.sync_batchnorm=true", "model.head=bn_mlp"], "sync_batchnorm=true needs CUDA GPUs"),
        (["trainer.strategy=foo"], "trainer.strategy=foo is unknown"),
        (["~logger"], "callbacks.learning_rate_monitor needs a logger"),
        (["data.max_patches=200"], "data.max_patches=200 exceeds data.row_len=144"),
        (["model.head=mlp"], "model.head='mlp' is unknown: use one of ['bn_mlp', 'linear']"),
        (["model.net.attention=dense"], "model.net.attention='dense' is unknown"),
        (["model.net.attention=flex"], "model.net.attention=flex cannot train on CPU"),
        (["data.multiprocessing_context=forx"], "data.multiprocessing_context='forx' is unknown: use one of"),
        (["data=imagefolder"], "data.root must be set: add data.root=/path/to/images to the command"),
    ],
)
def test_refusal_is_one_line_and_exit_code_2(run_entry_point, overrides, message):
    # as a machine without a GPU sees them, also where the suite runs on one
    result = run_entry_point("train.py", *overrides, check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.slow
def test_an_unknown_strategy_option_is_refused_with_the_options(run_entry_point):
    result = run_entry_point("train.py", "strategy=foo", check=False)
    assert result.returncode != 0
    assert "Could not find 'strategy/foo'" in result.stderr and "ddp_spawn" in result.stderr
