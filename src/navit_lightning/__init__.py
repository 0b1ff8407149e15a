"""NaViT (Patch n' Pack) training template on PyTorch Lightning and Hydra."""

from pathlib import Path

__version__ = "0.1.0"

# The Hydra configs of an installed checkout (pip install -e .): <repo>/configs.
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")
