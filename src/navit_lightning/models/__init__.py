from navit_lightning.models.navit import NaViT

__all__ = ["NaViT"]
