# make train: set up .venv and train on the built-in data; make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned; pip takes the build its index offers: these machines' local CPU wheel, from
# PyPI on Linux the CUDA build (several GB). TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build from PyTorch's index. On a GPU machine install the torch build for your
# CUDA into .venv first and pass TORCH=torch.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
VIT_PYTORCH := 1.26.11

.PHONY: setup setup-dev train test lint clean clean-logs

# Re-installs when pyproject.toml changes. pip byte-compiles on one core; compileall does it
# after each install on every core (23 s less of 1 min 54 s on 2 cores, measured when one
# install held the dev extras too; it skips files already compiled). The .pyc files must be
# written here: where PYTHONDONTWRITEBYTECODE is set, a process would compile at every start.
# Like pip, it does not stop on a file that does not compile (an import of it would fail).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/pip install --quiet --no-compile -e .
	@# The attention benchmark's peer: --no-deps, its requirements would pull torchvision.
	$(BIN)/pip install --quiet --no-compile --no-deps "vit-pytorch==$(VIT_PYTORCH)"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

# The tests' and hooks' tools, and the extras they test (the SLURM launcher, the MLflow client
# and W&B: 0.1 GB of 1.6), which training on the built-in data does without.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet --no-compile -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

train: setup
	$(BIN)/python train.py $(ARGS)

# Three test processes (pytest-xdist) with one OpenMP thread each, on 2 cores: a test is
# mostly the start-up of train.py processes and waits between them, which a third worker fills;
# two threads per process would spin against each other. TEST_WORKERS=0 runs them serially.
TEST_WORKERS ?= 3

test: setup-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

lint: setup-dev
	PATH="$(CURDIR)/$(BIN):$$PATH" pre-commit run --all-files

# the tools' caches and build output; the runs (logs/) and the built-in data stay
clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build dist
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

# every run, checkpoint and the MLflow database under logs/
clean-logs:
	rm -rf logs
