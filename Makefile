# `make demo` and `make test` do all of the set-up on a fresh machine.
#
# TORCH picks the PyTorch requirement installed before the project. The default takes the
# CPU build that lies on these machines' disk; a GPU user sets, for example,
#   make test TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
# and a CPU user elsewhere TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint typecheck docs bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	# The frameworks tests/agent/test_frameworks.py checks, without the dependencies they pin for
	# training (litgpt would downgrade huggingface_hub; torchtitan pulls ~35 packages). torchtitan
	# imports triton even on the CPU.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps litgpt==0.5.13 torchtitan==0.3.0 \
		spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 triton==3.9.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/qkwatch demo

# make test = make check, then the tests; CI runs exactly this (.ci/run). Two pytest processes, each
# test handed to whichever is free (worksteal): 9 minutes here against 15 in one process, since most
# tests wait on a collector, a browser or a training subprocess. Tests take free ports and fresh
# databases (qkwatch_test_<random>), so they do not see each other's state.
test: check
	$(BIN)/pytest -q -n 2 --dist worksteal

# What pre-commit runs (.pre-commit-config.yaml): format, lint, mypy strict on the package, the docs site.
check: lint typecheck docs

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link, anchor or nav entry fails.
# NO_MKDOCS_2_WARNING silences Material's banner about its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python -m bench.metrics

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
