"""Runs navit_lightning.eval from the repository root: python eval.py [overrides]."""

import os

os.environ.setdefault("PROJECT_ROOT", os.path.dirname(os.path.abspath(__file__)))

from navit_lightning.eval import main

if __name__ == "__main__":
    main()
