"""Settings this machine cannot run are refused before any process starts, with one line."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from navit_lightning.train import CONFIG_DIR
from navit_lightning.utils.validate import ConfigError, check_launch


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
    ],
)
def test_refused(monkeypatch, gpus, overrides, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_launch(config(*overrides))


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
    ],
)
def test_allowed(monkeypatch, gpus, overrides):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    check_launch(config(*overrides))


@pytest.mark.slow
def test_refusal_is_one_line_and_exit_code_2(run_entry_point):
    result = run_entry_point("train.py", "trainer.precision=16-mixed", check=False)
    assert result.returncode == 2
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and "trainer.precision=16-mixed needs a CUDA GPU" in errors[0]
