"""What the machine's CPU offers and what the native engines were built with.

llama.cpp compiles with the building machine's own instruction sets (``-march=native``), so a
build is only as portable as its flags. Its AMX kernels (Intel Xeon, Sapphire Rapids and later)
fault on the first token in llama-cpp-python 0.3.36 (``ldtilecfg``, SIGSEGV): the Makefile builds
without them, and :func:`amx_instructions` reads a built library's code for any AMX instruction,
so the check holds on any CPU, not only on one with AMX.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
# The instructions only AMX code contains: tile configuration, loads, stores and dot products.
_AMX = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|tdp\w+)\b")


@dataclass(frozen=True)
class Cpu:
    model: str
    flags: frozenset[str]

    @property
    def kind(self) -> str:
        """The kinds these machines come in: AVX2 only, AVX-512 VNNI, AVX-512 VNNI with AMX."""
        if {"amx_tile", "amx_int8"} <= self.flags:
            return "AVX-512 VNNI + AMX"
        if "avx512_vnni" in self.flags:
            return "AVX-512 VNNI"
        if "avx2" in self.flags:
            return "AVX2"
        return "no AVX2"


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> Cpu:
    model, flags = "unknown", frozenset[str]()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return Cpu(model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return Cpu(model, flags)


def llama_libraries() -> list[Path]:
    """The native libraries llama-cpp-python loads (its ``lib`` folder)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return []
    return sorted(p for p in (Path(spec.origin).parent / "lib").glob("*.so"))


class NoDisassembler(RuntimeError):
    pass


def amx_instructions(library: Path) -> int:
    """How many AMX instructions the library's code holds (objdump's disassembly)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise NoDisassembler("objdump not found (Debian: binutils)")
    out = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True, check=True
    ).stdout
    return len(_AMX.findall(out))


def llama_system_info() -> str:
    """ggml's own account of the CPU features it was compiled for (``AVX512 = 1 | AMX_INT8 = 0 ...``)."""
    import llama_cpp

    raw = llama_cpp.llama_print_system_info()
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).strip()
