from navit_lightning.models.heads import build_head
from navit_lightning.models.navit import NaViT

__all__ = ["NaViT", "build_head"]
