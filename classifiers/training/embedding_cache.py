"""The encoder's readings of training rows kept on disk (:class:`EmbeddingCache`), so a re-run
(other C, other heads) does not embed the same rows again; and the served encoder with its cache
(:func:`embedding_cache`), as every fit and ``triage cache fit`` open it."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from classifiers.artifacts import ExportSettings, locate
from classifiers.encoder import Encoder, EncoderSettings, Reading
from policies.paths import cache_dir
from policies.schema import ClassifierSpec

READINGS = "r2"  # bump when what Encoder.read returns besides the embedding changes (a new cache file)


class EmbeddingCache:
    """Readings (embedding, the guard layer's view, foreign share, language) by SHA-1 of the text,
    for one encoder export, precision and ``READINGS`` version, kept on disk so a re-run (other C,
    other heads) does not embed the same rows again. The guard's view is stored as float16."""

    def __init__(self, encoder: Encoder, path: Path | None) -> None:
        self.encoder = encoder
        self.path = path
        self.rows: dict[bytes, Reading] = {}
        if path is not None and path.is_file():
            with np.load(path, allow_pickle=False) as a:
                ends = np.cumsum(a["counts"])
                parts = np.split(a["segments"].astype(np.float32), ends[:-1]) if len(ends) else []
                self.rows = {
                    bytes(k): Reading(v, seg, float(f), str(lang), sh.astype(np.float32))
                    for k, v, seg, f, lang, sh in zip(
                        a["keys"], a["vectors"], parts, a["foreign"], a["languages"], a["shallow"], strict=True
                    )
                }

    def read(self, texts: list[str], batch: int = 64) -> list[Reading]:
        keys = [hashlib.sha1(t.encode("utf-8", "replace")).digest() for t in texts]
        missing = sorted(
            {k: t for k, t in zip(keys, texts, strict=True) if k not in self.rows}.items(), key=lambda kv: len(kv[1])
        )  # similar lengths share a batch
        for start in range(0, len(missing), batch):
            part = missing[start : start + batch]
            for (k, _), r in zip(part, self.encoder.read([t for _, t in part]), strict=True):
                # the guard's view is kept as float16: a first run reads it as a re-run will
                assert r.shallow is not None
                self.rows[k] = dataclasses.replace(
                    r,
                    segments=r.segments.astype(np.float16).astype(np.float32),
                    shallow=r.shallow.astype(np.float16).astype(np.float32),
                )
        return [self.rows[k] for k in keys]

    def embed(self, texts: list[str]) -> np.ndarray:
        readings = self.read(texts)
        return np.array([r.vector for r in readings], dtype=np.float32).reshape(len(texts), self.encoder.dim)

    def save(self) -> None:
        if self.path is None or not self.rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = list(self.rows.values())
        keys = np.array([np.frombuffer(k, dtype=np.uint8) for k in self.rows])
        tmp = self.path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            keys=keys,
            vectors=np.array([r.vector for r in rows], dtype=np.float32),
            foreign=np.array([r.foreign for r in rows], dtype=np.float64),
            languages=np.array([r.language for r in rows], dtype="<U8"),
            counts=np.array([len(r.segments) for r in rows], dtype=np.int32),
            segments=np.concatenate([r.segments for r in rows]).astype(np.float16),
            shallow=np.array([r.shallow for r in rows], dtype=np.float16),
        )
        tmp.replace(self.path)


def embedding_cache(cfg: ClassifierSpec, threads: int, suffix: str = "") -> EmbeddingCache:
    """The served encoder, and its embeddings of training rows kept on disk."""
    e = cfg.encoder
    art = locate(settings=ExportSettings(layers=e.layers))
    settings = EncoderSettings(
        precision=e.precision, intra_op_threads=threads, provider=e.provider, max_tokens=e.max_tokens, rows=e.rows
    )
    encoder = Encoder.load(settings, artifacts=art)
    # batched int8 rows differ; READINGS names the rules of sentences, foreign share and language
    tag = f"{art.key}-{e.precision}-{e.max_tokens}" + ("-apart" if settings.apart else "") + f"-{READINGS}"
    return EmbeddingCache(encoder, cache_dir() / "embeddings" / f"{tag}{suffix}.npz")
