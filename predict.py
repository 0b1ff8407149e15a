"""Runs navit_lightning.predict from the repository root: python predict.py [overrides]."""

# Imported under the guard: multiprocessing runs this file again in the loader workers'
# server and in ddp_spawn's ranks, which import what they need themselves.
if __name__ == "__main__":
    from navit_lightning.predict import main

    main()
