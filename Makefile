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

.PHONY: demo test check lint typecheck bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/qkwatch demo

# make test = make check, then the tests; CI runs exactly this (.ci/run).
test: check
	$(BIN)/pytest -q

# What pre-commit runs (.pre-commit-config.yaml): format, lint, and mypy strict on the package.
check: lint typecheck

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench.metrics

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
