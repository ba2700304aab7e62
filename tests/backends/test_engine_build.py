"""The native build and `triage doctor` on it: llama.cpp compiled without the AMX kernels that
fault on Intel Xeons (and a check that would find them), and the doctor's report of the machine,
one token through each engine, and what to do when a model does not load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends import native
from tests.backends.test_engines import POLICY


@pytest.mark.engine
def test_llama_cpp_is_built_without_amx_kernels() -> None:
    """On every CPU: the libraries llama-cpp-python loads hold no AMX instruction (they fault on
    the first token on AMX CPUs; the Makefile builds without them)."""
    libraries = native.llama_libraries()
    assert any(lib.name.startswith("libggml-cpu") for lib in libraries), libraries
    assert {lib.name: native.amx_instructions(lib) for lib in libraries} == {lib.name: 0 for lib in libraries}


def test_the_amx_check_finds_amx_code(tmp_path: Path) -> None:
    """The check is not vacuous: code compiled for AMX (any CPU compiles it) is found."""
    gcc = shutil.which("gcc")
    assert gcc is not None
    src = tmp_path / "amx.c"
    src.write_text(
        "#include <immintrin.h>\n"
        "void f(const void *cfg, void *buf) { _tile_loadconfig(cfg); _tile_loadd(0, buf, 64); _tile_release(); }\n"
    )
    out = tmp_path / "amx.so"
    subprocess.run([gcc, "-O2", "-mamx-tile", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    assert native.amx_instructions(out) == 3
    subprocess.run(
        [gcc, "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(out)], input=b"int g(void){return 1;}", check=True
    )
    assert native.amx_instructions(out) == 0


@pytest.mark.engine
def test_doctor_reports_the_machine_and_runs_a_token_through_each_engine(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor", "--policy", str(policy)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ("cpu", "llama.cpp AMX kernels", "onnxruntime", "engine local", "engine scorer", "state store"):
        assert row in done.stdout
    assert native.cpu().kind in done.stdout


@pytest.mark.engine
def test_doctor_fails_with_what_to_do_when_a_model_does_not_load(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f'version: 1\nbackends:\n  b: {{type: llamacpp, gguf: {{path: "{broken}"}}}}\nmodels:\n  m: {{backend: b}}\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor", "--policy", str(policy)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=300,
    )
    assert done.returncode == 1
    assert "engine b" in done.stdout and "FAIL" in done.stdout


# --- hostile schemas (issue: hardening, round two) ---------------------------------------------------------
