"""Runs navit_lightning.train from the repository root: python train.py [overrides]."""

# Imported under the guard: multiprocessing runs this file again in the loader workers'
# server and in ddp_spawn's ranks, which import what they need themselves.
if __name__ == "__main__":
    from navit_lightning.train import main

    main()
