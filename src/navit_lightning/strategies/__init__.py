from navit_lightning.strategies.ddp import HydraDDPStrategy
from navit_lightning.strategies.dp import PackedDataParallelStrategy, devices_per_process

__all__ = ["HydraDDPStrategy", "PackedDataParallelStrategy", "devices_per_process"]
