"""NaViT (Patch n' Pack) training template on PyTorch Lightning and Hydra."""

__version__ = "0.1.0"
