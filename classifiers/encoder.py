"""The sentence encoder: the exported MiniLM run by ONNX Runtime, tokenized by ``tokenizers``.

Embeddings match sentence-transformers' all-MiniLM-L6-v2 (mean pooling over the real tokens, L2
normalised; both inside the exported graph), 384 float32 values per text.

Truncation policy (prompts longer than ``max_tokens``, 256 by default, the model's own limit):
the encoder keeps the HEAD and the TAIL of the prompt and drops the middle. Of the
``max_tokens - 2`` word-piece slots ([CLS] and [SEP] take two), the first half goes to the first
tokens and the second half to the last tokens: an instruction usually sits at the start of a
prompt and the question at its end. (sentence-transformers keeps the head only.) To bound the
cost of tokenizing huge prompts, text longer than twice ``CHARS_PER_TOKEN * slots`` characters is
first cut to that many characters from each end; for ordinary text (4-6 characters a token) this
changes nothing the encoder keeps.

Text that is not valid Unicode (lone surrogates from ``surrogateescape`` decoding) has the
offending code points replaced by U+FFFD; ``bytes`` are decoded as UTF-8 with replacement. The
empty prompt encodes as ``[CLS] [SEP]``.

Parts of a prompt. ``read`` also returns, from the same forward, the guard's view: the token
states after an earlier layer (``ExportSettings.guard_layer``, 3 of 6) mean-pooled and
L2-normalised over the whole prompt and over each sentence (contextual, so not the embedding a
sentence would get alone), the share of the prompt's word pieces that
are foreign to the model's English vocabulary (continuation pieces ``##..``, [UNK], pieces
outside ASCII) and the prompt's language (:mod:`classifiers.language`). Sentences end at ``.``,
``!``, ``?``, ``:`` or ``;`` after two non-spaces and before a space, at a line break, and
around brackets; a prompt of one sentence has no parts; of more than ``MAX_SEGMENTS``, the first
and last halves of that many are kept (an instruction aimed at the router tends to sit at
either end).

Nothing is loaded at import. An :class:`Encoder` holds one ONNX Runtime session; calls from
several threads are safe but compete for the same cores, so serve it through the micro-batcher,
which gives it one worker thread.

Rows. int8 activations are quantized at run time with one scale per tensor, so an int8 row
run in a batch depends slightly on the other rows and on their padding (cosine to the same
prompt alone 0.97-0.99): a decision would move with concurrent traffic. ``rows="apart"`` (the
default for int8, ``rows="auto"``) runs every row of a call as its own forward, unpadded, so a
prompt's embedding is the same whatever arrives with it. That costs about a fifth of the
micro-batched throughput on equal 32-token prompts (``python -m benchmarks encoder``: 100 against 130
decisions/s on one core); ``rows="together"`` (the default for fp32, whose rows do not depend on
each other: differences ~1e-7) runs one padded forward.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from classifiers.artifacts import EXPORT_COMMAND, Artifacts, ExportSettings, Precision, locate
from classifiers.language import UNKNOWN, detect
from policies.errors import InvalidRequest, NotReady

CHARS_PER_TOKEN = 16
CPU = "CPUExecutionProvider"
CPU_UNFUSED = ("SkipLayerNormFusion",)  # ONNX Runtime graph fusions slower than what they fuse on CPU
MAX_SEGMENTS = 16
MIN_SEGMENT_PIECES = 2
# a sentence end after two non-spaces (so "A. 4" and "1. step" stay whole), a line break, brackets
_BOUNDARY = re.compile(r"(?<=\S\S[.!?:;])\s+|\n+|\s+(?=[(\[{])|(?<=[)\]}])\s+")


@dataclass(frozen=True)
class EncoderSettings:
    precision: Precision = "int8"
    intra_op_threads: int = 1  # measured: 1 thread is fastest for one prompt on these 2-core machines
    provider: str = CPU  # "CUDAExecutionProvider" with onnxruntime-gpu on GPU hosts
    max_tokens: int = 256  # including [CLS] and [SEP]; at most the model's 512 positions
    spin: bool = False  # let idle intra-op threads busy-wait (only matters with 2+ threads)
    rows: Literal["auto", "apart", "together"] = "auto"  # auto: apart for int8, together for fp32
    skip_layer_norm: bool = False  # let ONNX Runtime fuse SkipLayerNormalization (slower here: bench encoder)

    @property
    def apart(self) -> bool:
        """Each row its own forward (see the module's docstring)."""
        return self.rows == "apart" or (self.rows == "auto" and self.precision == "int8")

    def __post_init__(self) -> None:
        if self.precision not in ("int8", "fp32"):
            raise InvalidRequest(f"encoder precision must be int8 or fp32, not {self.precision!r}")
        if self.intra_op_threads < 1:
            raise InvalidRequest("encoder intra_op_threads must be at least 1")
        if not 3 <= self.max_tokens <= 512:
            raise InvalidRequest("encoder max_tokens must be between 3 and 512")
        if self.rows not in ("auto", "apart", "together"):
            raise InvalidRequest(f"encoder rows must be auto, apart or together, not {self.rows!r}")


@dataclass(frozen=True)
class Encoded:
    """Token ids of one prompt, with [CLS]/[SEP], after truncation."""

    ids: list[int]
    original_tokens: int  # word pieces of the full prompt plus two (after the character cut, if any)
    truncated: bool
    segments: tuple[tuple[int, int], ...] = ()  # [start, end) positions in ``ids`` of each sentence (2+ only)
    foreign: float = 0.0  # share of the word pieces foreign to the English vocabulary
    language: str = UNKNOWN  # CLD2's reliable answer, else "un"


@dataclass(frozen=True, eq=False)
class Reading:
    """What one forward gives for one prompt: its embedding, its sentences', its foreign share and
    its language."""

    vector: np.ndarray  # (dim,), unit length: what the heads read
    segments: np.ndarray  # (k, dim), unit length, at the guard layer; k = 0 for a prompt of one sentence
    foreign: float
    language: str = UNKNOWN
    shallow: np.ndarray | None = None  # (dim,), unit length: the whole prompt at the guard layer


class Encoder:
    def __init__(self, model: Path, tokenizer: Path, settings: EncoderSettings | None = None) -> None:
        self.settings = settings or EncoderSettings()
        if self.settings.provider not in ort.get_available_providers():
            raise NotReady(
                f"ONNX Runtime provider {self.settings.provider} is not available "
                f"(available: {', '.join(ort.get_available_providers())}); on GPU hosts install onnxruntime-gpu"
            )
        self._tok = Tokenizer.from_file(str(tokenizer))
        self._tok.no_truncation()
        self._tok.no_padding()
        self._cls, self._sep, self._pad = (self._special(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
        vocab = self._tok.get_vocab()
        self._foreign = np.zeros(max(vocab.values()) + 1, dtype=bool)
        for piece, i in vocab.items():
            self._foreign[i] = piece.startswith("##") or not piece.isascii()
        self._foreign[self._special("[UNK]")] = True
        self._session = _open(model, self.settings)
        # rows apart on several CPU threads: a batch's rows spread over one 1-thread session per
        # thread (a row is too small to split well over threads); a single prompt keeps the N-thread one
        self._lanes, self._pool = [self._session], None
        n = self.settings.intra_op_threads
        if self.settings.apart and n > 1 and self.settings.provider == CPU:
            one = dataclasses.replace(self.settings, intra_op_threads=1)
            self._lanes = [_open(model, one) for _ in range(n)]
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="triage-encoder-lane")
        outputs = self._session.get_outputs()
        if len(outputs) < 2:
            raise NotReady(f"encoder export {model.parent} has no token output: re-export with `{EXPORT_COMMAND}`")
        self._output, self._tokens = outputs[0].name, outputs[1].name
        self.dim = int(outputs[0].shape[-1])

    @classmethod
    def load(
        cls,
        settings: EncoderSettings | None = None,
        *,
        artifacts: Artifacts | None = None,
        export: ExportSettings | None = None,
        cache_root: Path | None = None,
    ) -> Encoder:
        """The encoder over a cached export (NotReady naming the export command when it is missing)."""
        opts = settings or EncoderSettings()
        art = artifacts if artifacts is not None else locate(settings=export, cache_root=cache_root)
        return cls(art.model(opts.precision), art.tokenizer, opts)

    def _special(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise NotReady(f"encoder tokenizer has no {token} token")
        return found

    @property
    def slots(self) -> int:
        return self.settings.max_tokens - 2

    def encode(self, text: str | bytes, parts: bool = True) -> Encoded:
        """Tokenize one prompt under the truncation policy (see the module's docstring); with
        ``parts``, also find its sentences, its foreign share and its language."""
        clean = _clean(text)
        window = CHARS_PER_TOKEN * self.slots
        if len(clean) > 2 * window:
            clean = f"{clean[:window]} {clean[-window:]}"
        encoding = self._tok.encode(clean, add_special_tokens=False)
        pieces, starts = encoding.ids, [a for a, _ in encoding.offsets]
        original = len(pieces) + 2
        foreign = float(self._foreign[pieces].mean()) if pieces and parts else 0.0
        if len(pieces) > self.slots:
            tail = self.slots // 2
            keep = self.slots - tail
            pieces = pieces[:keep] + (pieces[-tail:] if tail else [])
            starts = starts[:keep] + (starts[-tail:] if tail else [])
        return Encoded(
            ids=[self._cls, *pieces, self._sep],
            original_tokens=original,
            truncated=original > self.settings.max_tokens,
            segments=_segments(clean, starts) if parts else (),
            foreign=foreign,
            language=detect(clean) if parts else UNKNOWN,
        )

    def embed(self, texts: Sequence[str | bytes]) -> np.ndarray:
        """Embeddings of ``texts`` in order: float32 ``[len(texts), dim]``, unit length. One forward,
        or one per row when the settings keep rows apart."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([r.vector for r in self._run([self.encode(t, parts=False) for t in texts], parts=False)])

    def embed_counted(self, texts: Sequence[str | bytes]) -> list[tuple[np.ndarray, int]]:
        """Each text's embedding with its token count before truncation (``/v1/embeddings``' usage)."""
        if not texts:
            return []
        rows = [self.encode(t, parts=False) for t in texts]
        return [(r.vector, row.original_tokens) for r, row in zip(self._run(rows, parts=False), rows, strict=True)]

    def read(self, texts: Sequence[str | bytes]) -> list[Reading]:
        """Each prompt's embedding, its sentences' embeddings, its foreign share and its language (see
        the module)."""
        return self.read_encoded([self.encode(t) for t in texts])

    def read_encoded(self, rows: Sequence[Encoded]) -> list[Reading]:
        """:meth:`read` of prompts already encoded (with their parts) by :meth:`encode`."""
        return self._run(list(rows), parts=True) if rows else []

    def _run(self, rows: list[Encoded], parts: bool) -> list[Reading]:
        if not self.settings.apart or len(rows) == 1:
            return self._forward(rows, self._session, parts)
        if self._pool is None:
            return [r for row in rows for r in self._forward([row], self._session, parts)]
        lanes = len(self._lanes)
        done = list(
            self._pool.map(
                lambda k: [self._forward([r], self._lanes[k], parts)[0] for r in rows[k::lanes]], range(lanes)
            )
        )
        out: list[Reading] = [None] * len(rows)  # type: ignore[list-item]
        for k, part in enumerate(done):
            out[k::lanes] = part
        return out

    def _forward(self, rows: list[Encoded], session: ort.InferenceSession, parts: bool) -> list[Reading]:
        width = max(len(r.ids) for r in rows)
        ids = np.full((len(rows), width), self._pad, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r.ids)] = r.ids
            mask[i, : len(r.ids)] = 1
        out = session.run(
            [self._output, self._tokens] if parts else [self._output], {"input_ids": ids, "attention_mask": mask}
        )
        vectors = np.asarray(out[0], dtype=np.float32)
        none = np.zeros((0, self.dim), dtype=np.float32)
        readings = []
        for i, r in enumerate(rows):
            if not parts:
                readings.append(Reading(vectors[i], none, r.foreign, r.language))
                continue
            tokens = np.asarray(out[1][i], dtype=np.float32)
            pooled = np.stack([tokens[: len(r.ids)].mean(axis=0), *(tokens[a:b].mean(axis=0) for a, b in r.segments)])
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-9)
            readings.append(Reading(vectors[i], pooled[1:], r.foreign, r.language, pooled[0]))
        return readings

    def embed_one(self, text: str | bytes) -> np.ndarray:
        return self.embed([text])[0]


def _open(model: Path, settings: EncoderSettings, optimized_to: Path | None = None) -> ort.InferenceSession:
    """A session on ``model`` (``optimized_to``: write the graph it runs there). On the CPU
    provider ONNX Runtime's own SkipLayerNormFusion is off unless ``skip_layer_norm``: its fused
    kernel is slower here than the Add and LayerNormalization it replaces (``python -m benchmarks
    encoder``, contestant ``onnx-int8-sln``; the export does not fuse them either)."""
    opts = _session_options(settings)
    if optimized_to is not None:
        opts.optimized_model_filepath = str(optimized_to)
    disabled = list(CPU_UNFUSED) if settings.provider == CPU and not settings.skip_layer_norm else []
    return ort.InferenceSession(str(model), opts, providers=[settings.provider], disabled_optimizers=disabled)


def _session_options(settings: EncoderSettings) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = settings.intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.spin else "0")
    opts.log_severity_level = 3
    return opts


def _segments(text: str, starts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sentence spans over the kept word pieces (positions in ``ids``, after [CLS]); empty for one."""
    bounds = [m.end() for m in _BOUNDARY.finditer(text)]
    if not bounds or not starts:
        return ()
    spans: list[tuple[int, int]] = []
    current, first = bisect.bisect_right(bounds, starts[0]), 0
    for j in range(1, len(starts) + 1):
        here = bisect.bisect_right(bounds, starts[j]) if j < len(starts) else -1
        if here != current:
            if j - first >= MIN_SEGMENT_PIECES:
                spans.append((first + 1, j + 1))
            current, first = here, j
    if len(spans) < 2:
        return ()
    if len(spans) > MAX_SEGMENTS:
        half = MAX_SEGMENTS // 2
        spans = spans[:half] + spans[-half:]
    return tuple(spans)


def _clean(text: str | bytes) -> str:
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: pair what pairs, replace the rest with U+FFFD
        return text.encode("utf-16", errors="surrogatepass").decode("utf-16", errors="replace")
    return text
