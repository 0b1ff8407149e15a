"""Runs navit_lightning.predict from the repository root: python predict.py [overrides]."""

import os

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))

from navit_lightning.predict import main

if __name__ == "__main__":
    main()
