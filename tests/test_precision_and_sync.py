"""Precision and strategy choices train (on a GPU where there is one); sync_batchnorm
converts the BatchNorm head for GPU ddp."""

import hydra
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.accelerators import cuda as fabric_cuda
from lightning.pytorch.accelerators import CUDAAccelerator
from omegaconf import open_dict, read_write

from tests.conftest import TINY_RUN
from tests.test_configs import compose_train


def test_sync_batchnorm_turns_the_heads_batchnorm_into_syncbatchnorm_under_gpu_ddp(
    monkeypatch, tmp_path, project_root
):
    """The trainer our configs build for 2 GPUs converts the model as DDPStrategy.setup does
    (Lightning's layer sync); inspected here without CUDA or NCCL."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    overrides = ["strategy=ddp", "trainer.devices=2", "trainer.sync_batchnorm=true", "model.head=bn_mlp"]
    cfg = compose_train(overrides, tmp_path, project_root)
    with open_dict(cfg):
        cfg.model.num_classes = 6
    model = hydra.utils.instantiate(cfg.model)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=False, callbacks=[])
    assert [d.type for d in trainer.strategy.parallel_devices] == ["cuda", "cuda"]
    converted = trainer.strategy._layer_sync.apply(model)
    norms = [
        type(m).__name__ for m in converted.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    assert norms == ["SyncBatchNorm"]


BF16 = "Using bfloat16 Automatic Mixed Precision"
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def case(accelerator: str, *overrides: str, announced: str | None = None):
    marks = [ON_GPU] if accelerator == "gpu" else []
    return pytest.param(
        accelerator, list(overrides), announced, marks=marks, id="-".join((accelerator, *overrides))
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("accelerator", "overrides", "announced"),
    [
        case("cpu", "trainer.precision=bf16-mixed", announced=BF16),
        case("cpu", "trainer.precision=32-true", "model.head=bn_mlp"),
        case("cpu", "trainer.precision=bf16-mixed", "model.head=bn_mlp", "strategy=ddp", "trainer.devices=2"),
        # The strategies and precisions a one-GPU machine can run; attention auto: varlen under
        # bf16, flex in float32.
        case("gpu", "trainer.precision=bf16-mixed", announced=BF16),
        case("gpu", "strategy=dp", "trainer.devices=1", "model.head=bn_mlp"),
        case("gpu", "strategy=dp", "trainer.devices=1", "model.net.grad_checkpointing=true"),
        case("gpu", "strategy=ddp", "trainer.devices=1", "trainer.sync_batchnorm=true", "model.head=bn_mlp"),
    ],
)
def test_precisions_strategies_and_the_batchnorm_head_train(
    run_entry_point, accelerator, overrides, announced
):
    result = run_entry_point(
        "train.py", *TINY_RUN, f"trainer.accelerator={accelerator}", *overrides, "test=false"
    )
    if announced:
        assert announced in result.stdout + result.stderr
    last = next((run_entry_point.root / "logs" / "train" / "runs").glob("*/checkpoints/last.ckpt"))
    state = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    if "model.head=bn_mlp" in overrides:
        assert state["head.1.num_batches_tracked"] > 0 and state["head.1.running_mean"].abs().sum() > 0


def test_ddp_spawn_ranks_take_the_float32_matmul_precision_of_the_launching_process(tmp_path, project_root):
    """train.py sets "high" (TF32 matmuls on a GPU) in the launching process; ddp_spawn's ranks
    are fresh interpreters, to which Lightning hands only its own global state."""
    overrides = ["strategy=ddp_spawn", "trainer.accelerator=cpu", "trainer.devices=2"]
    cfg = compose_train(overrides, tmp_path, project_root)
    with read_write(cfg.hydra), open_dict(cfg.hydra):  # the ranks' log file: a run sets it
        cfg.hydra.runtime.output_dir = str(tmp_path)
    HydraConfig().set_config(cfg)
    trainer = hydra.utils.instantiate(cfg.trainer, logger=False, callbacks=[])
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # neither torch's default nor train.py's
        ranks_precision = trainer.strategy.launcher.launch(torch.get_float32_matmul_precision)
    finally:
        torch.set_float32_matmul_precision(before)
    assert ranks_precision == "medium"
