# make train: set up .venv and train on the built-in data; make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build these machines carry; on a GPU machine install the torch
# build for your CUDA into .venv first and pass TORCH=torch.
TORCH ?= torch==2.13.0
VIT_PYTORCH := 1.26.11

.PHONY: setup train test lint clean

# Re-installs when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	# The attention benchmark's peer: --no-deps, its requirements would pull torchvision.
	$(BIN)/pip install --quiet --no-deps "vit-pytorch==$(VIT_PYTORCH)"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(BIN)/python train.py $(ARGS)

# Three test processes (pytest-xdist) with one OpenMP thread each, on 2 cores: a test is
# mostly the start-up of train.py processes and waits between them, which a third worker fills;
# two threads per process would spin against each other. TEST_WORKERS=0 runs them serially.
TEST_WORKERS ?= 3

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

lint: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" pre-commit run --all-files

clean:
	rm -rf logs .pytest_cache .ruff_cache
