"""strategy=dp: one process driving several GPUs, for packed batches.

Lightning 2.x dropped its DataParallel strategy. This one keeps what made DP simple (one
process, no launcher) and fixes what made it wrong: the LightningModule's step runs once,
in this process; only its network (`lightning_module.net`) runs on every GPU, each replica
on its share of the batch's rows (every PackedBatch field is row-local, so a share of rows
is a valid batch), and the per-image features come back to the first GPU. Loss, head and
torchmetrics then see the whole batch in one place: no metric state is lost in replicas,
and a BatchNorm head normalises over every image of the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.nn.parallel import replicate

from navit_lightning.batch import PackedBatch


def split_rows(batch: PackedBatch, devices: Sequence[torch.device]) -> list[PackedBatch]:
    """Near-equal shares of the batch's rows, one per device (fewer when rows < devices)."""
    shares = min(len(devices), batch.patches.shape[0])
    fields = [field.tensor_split(shares) for field in batch]
    return [
        PackedBatch(*(part.to(device, non_blocking=True) for part in parts))
        for parts, device in zip(zip(*fields, strict=True), devices[:shares], strict=True)
    ]


def apply_replicas(
    replicas: Sequence[nn.Module], shares: Sequence[PackedBatch], devices: Sequence[torch.device]
) -> list[torch.Tensor]:
    """Run each replica on its share in its own thread, under the caller's grad mode and
    autocast. torch's parallel_apply passes autocast's on/off but not its dtype, which is
    thread-local: under bf16-mixed its replicas would compute in float16."""
    grad_enabled = torch.is_grad_enabled()
    device_type = devices[0].type
    autocast = dict(
        device_type=device_type,
        enabled=torch.is_autocast_enabled(device_type),
        dtype=torch.get_autocast_dtype(device_type),
    )
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    outputs: list[Any] = [None] * len(replicas)

    def run(i: int) -> None:
        on_device = torch.cuda.device(devices[i]) if streams[i] else nullcontext()
        on_stream = torch.cuda.stream(streams[i]) if streams[i] else nullcontext()
        try:
            with on_device, on_stream, torch.set_grad_enabled(grad_enabled), torch.autocast(**autocast):
                outputs[i] = replicas[i](shares[i])
        except Exception as error:  # re-raised in the caller's thread below
            outputs[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for output in outputs:
        if isinstance(output, Exception):
            raise output
    return outputs


class RowParallel(nn.Module):
    """`net` over a PackedBatch split by rows across `devices`; outputs concatenated on the first.

    On CUDA each device gets a replica (torch.nn.parallel.replicate: its backward sums the
    gradients into `net`'s parameters). On CPU, which has no replicas, every share runs the
    same module: the stand-in that lets the tests check this path without GPUs.
    """

    def __init__(self, net: nn.Module, devices: Sequence[torch.device]) -> None:
        super().__init__()
        self.net = net
        self.devices = list(devices)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        shares = split_rows(batch, self.devices)
        devices = self.devices[: len(shares)]
        if len(shares) == 1:
            return self.net(shares[0])
        if devices[0].type == "cuda":
            replicas = replicate(self.net, devices, detach=not torch.is_grad_enabled())
        else:
            replicas = [self.net] * len(devices)
        outputs = apply_replicas(replicas, shares, devices)
        return torch.cat([output.to(devices[0]) for output in outputs])


class PackedDataParallelStrategy(ParallelStrategy):
    """One process, `trainer.devices` GPUs: the batch (data.rows x devices rows) is split by
    rows over replicas of `lightning_module.net`; everything else runs once."""

    strategy_name = "packed_dp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._row_parallel: RowParallel | None = None

    @property
    def devices_per_process(self) -> int:
        """The devices that share this process's batch (read by the datamodule: it gives the
        process that many devices' rows)."""
        return len(self.parallel_devices or [None])

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "parallel_devices are set by the Trainer"
        return self.parallel_devices[0]

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": 1, "rank": 0}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._row_parallel = RowParallel(self.lightning_module.net, self.parallel_devices)

    @contextmanager
    def _rows_over_devices(self) -> Iterator[None]:
        """For one step, `lightning_module.net` is the row-parallel wrapper around itself."""
        module = self.lightning_module
        net = module.net
        module.net = self._row_parallel
        try:
            yield
        finally:
            module.net = net

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context(), self._rows_over_devices():
            return self.lightning_module.training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self._rows_over_devices():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self._rows_over_devices():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self._rows_over_devices():
            return self.lightning_module.predict_step(*args, **kwargs)

    # One process: nothing to reduce, gather, broadcast or wait for.
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def teardown(self) -> None:
        self._row_parallel = None
        super().teardown()
