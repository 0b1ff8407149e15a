from navit_lightning.strategies.ddp import HydraDDPStrategy
from navit_lightning.strategies.dp import PackedDataParallelStrategy

__all__ = ["HydraDDPStrategy", "PackedDataParallelStrategy"]
