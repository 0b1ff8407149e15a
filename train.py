"""Runs navit_lightning.train from the repository root: python train.py [overrides]."""

import os

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))

from navit_lightning.train import main

if __name__ == "__main__":
    main()
