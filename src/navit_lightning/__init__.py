"""NaViT (Patch n' Pack) training template on PyTorch Lightning and Hydra."""

import os
from pathlib import Path

__version__ = "0.1.0"

# The Hydra configs of an installed checkout (pip install -e .): <repo>/configs.
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def default_project_root() -> None:
    """Runs and data go under the checkout (logs/, data/), whatever the working folder and
    however the command was started (python train.py, a symlink to it, python -m), unless
    PROJECT_ROOT says where (configs/paths)."""
    os.environ.setdefault("PROJECT_ROOT", str(Path(CONFIG_DIR).parent))


def config_options(group: str) -> list[str]:
    """The options of a config group (strategy -> auto, ddp, ...), as a command chooses them."""
    return sorted(path.stem for path in Path(CONFIG_DIR, group).glob("*.yaml"))
