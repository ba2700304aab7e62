"""The encoder benchmark's contestants and prompts: ONNX int8, ONNX fp32, sentence-transformers.

Each contestant is a ``forward(texts) -> [n, 384]`` at a given thread count. ONNX Runtime fixes
its intra-op threads per session, so there is one session per thread count; PyTorch's count is
global (``torch.set_num_threads``), set before each use, and torch's OpenMP workers are given a
moment to stop spinning after a multi-threaded cell so that they do not steal the next cell's CPU.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from classifiers.artifacts import Artifacts, source_dir
from classifiers.encoder import Encoder, EncoderSettings

Forward = Callable[[Sequence[str]], np.ndarray]
ONNX_INT8, ONNX_FP32, PYTORCH = "onnx-int8", "onnx-fp32", "pytorch"
ONNX_INT8_TOGETHER = "onnx-int8-together"  # int8 with a batch's rows in one padded forward (not the default)
ONNX_INT8_SLN = "onnx-int8-sln"  # int8 with ONNX Runtime's SkipLayerNormFusion on (the export before format 3)
TORCH_SETTLE_S = 0.3

# common English words; those that are one word piece each make prompts of an exact length
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her this which are be have not had but "
    "one all were they there been has when who more will would no if out so said what up its about than "
    "into them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three question answer model "
    "route yes true false score rate choose option which best explain why short long legal medical code"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass
class Contestant:
    name: str
    forwards: dict[int, Forward]  # by intra-op thread count
    settle: Callable[[int], None]  # called with the thread count after a cell


def exact_prompts(encoder: Encoder, tokens: int, count: int, seed: int) -> list[str]:
    """``count`` prompts of exactly ``tokens`` tokens, [CLS] and [SEP] included (before truncation)."""
    single = [w for w in WORDS if len(encoder.encode(w).ids) == 3]
    rng = random.Random(seed * 1000 + tokens)
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(single) for _ in range(tokens - 2))
        assert encoder.encode(text).original_tokens == tokens, text
        out.append(text)
    return out


def onnx_contestant(
    name: str, art: Artifacts, precision: str, threads: Sequence[int], rows: str = "auto", skip_layer_norm: bool = False
) -> Contestant:
    encoders = {
        n: Encoder.load(
            EncoderSettings(
                precision=precision,
                intra_op_threads=n,  # type: ignore[arg-type]
                rows=rows,
                skip_layer_norm=skip_layer_norm,
            ),  # type: ignore[arg-type]
            artifacts=art,
        )
        for n in threads
    }
    return Contestant(name, {n: e.embed for n, e in encoders.items()}, lambda n: None)


def torch_contestant(threads: Sequence[int]) -> Contestant:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model: Any = SentenceTransformer(str(source_dir()), device="cpu")
    model.eval()

    def at(n: int) -> Forward:
        def forward(texts: Sequence[str]) -> np.ndarray:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
            with torch.inference_mode():
                return model.encode(
                    list(texts), batch_size=max(len(texts), 1), convert_to_numpy=True, show_progress_bar=False
                )

        return forward

    def settle(n: int) -> None:
        if n > 1:
            torch.set_num_threads(1)
            time.sleep(TORCH_SETTLE_S)

    return Contestant(PYTORCH, {n: at(n) for n in threads}, settle)


def torch_kept_tokens(tokens: int) -> int:
    """sentence-transformers keeps the first max_seq_length (256) tokens."""
    return min(tokens, 256)


def torch_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
