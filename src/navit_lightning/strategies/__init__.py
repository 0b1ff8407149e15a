from navit_lightning.strategies.dp import PackedDataParallelStrategy, devices_per_process

__all__ = ["PackedDataParallelStrategy", "devices_per_process"]
