from navit_lightning.data.packing import PackedBatch, PackedShape

__all__ = ["PackedBatch", "PackedShape"]
