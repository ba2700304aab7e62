"""``python -m benchmarks guard``: what the guard adds to the encoder's work per prompt.

The gateway reads a prompt with :meth:`Encoder.read` (the embedding, plus every sentence's
embedding pooled from the token output of the same forward, plus the share of foreign word
pieces); before the guard it called :meth:`Encoder.embed` (the embedding only). Both run here on
the same real prompts (a seeded sample of the typed and open test prompts and CLINC150 test
utterances: questions with passages and lettered options, one-line requests), one prompt at a
time and in micro-batches of ``batch``, int8 with one thread, in interleaved rounds whose order
alternates. Reported: milliseconds per prompt for each, the ratio read / embed, and how many
sentences the prompts have. ``embed`` tokenizes only; ``read`` also finds the sentences, the
foreign share and the language (CLD2), which is also timed on its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import report
from benchmarks.overhead import machine
from classifiers import datasets
from classifiers.encoder import Encoder, EncoderSettings
from classifiers.language import detect
from classifiers.training.export import ensure_exported

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@dataclass(frozen=True)
class Options:
    data: Path = DATA
    prompts: int = 200
    rounds: int = 4
    batch: int = 16
    out: Path = Path("out/bench-guard.json")


def sample(data: Path, n: int) -> list[str]:
    typed = datasets.subsample(datasets.question_type(data, "test", per_source_cap=100), n * 3 // 4, "bench-guard")
    intents = datasets.subsample(
        datasets.task(data / "intent" / "clinc150.jsonl.gz", "test"), n - len(typed), "bench-guard"
    )
    return typed.texts + intents.texts


def _time(fn: Callable[[Sequence[str]], object], texts: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, len(texts), batch):
        fn(texts[start : start + batch])
    return (time.perf_counter() - t0) * 1000 / len(texts)


def run(**kwargs: Any) -> dict[str, Any]:
    opts = Options(**kwargs)
    if min(opts.prompts, opts.rounds, opts.batch) < 1:
        raise ValueError("prompts, rounds and batch must be at least 1")
    console = Console(highlight=False)
    art, _ = ensure_exported()
    enc = Encoder.load(EncoderSettings(precision="int8", intra_op_threads=1), artifacts=art)
    texts = sample(opts.data, opts.prompts)
    sentences = [len(enc.encode(t).segments) for t in texts]
    contestants = {"embed": enc.embed, "read": enc.read}
    enc.read(texts[:8])  # warm-up
    times: dict[str, dict[int, list[float]]] = {name: {1: [], opts.batch: []} for name in contestants}
    for r in range(opts.rounds):
        order = list(contestants) if r % 2 == 0 else list(reversed(contestants))
        for size in (1, opts.batch):
            for name in order:
                times[name][size].append(_time(contestants[name], texts, size))
    language = []
    for _ in range(opts.rounds):
        t0 = time.perf_counter()
        for t in texts:
            detect(t)
        language.append((time.perf_counter() - t0) * 1000 / len(texts))
    cells = {name: {str(size): statistics.median(v) for size, v in by.items()} for name, by in times.items()}
    ratios = {str(size): cells["read"][str(size)] / cells["embed"][str(size)] for size in (1, opts.batch)}
    result = {
        "options": {k: str(v) for k, v in asdict(opts).items()},
        "ms_per_prompt": cells,
        "read_over_embed": ratios,
        "language_ms_per_prompt": statistics.median(language),
        "prompts": len(texts),
        "with_sentences": sum(s > 0 for s in sentences) / len(texts),
        "mean_sentences": statistics.mean(sentences),
        "machine": machine(),
    }
    table = Table(
        title=f"the guard's cost: {len(texts)} real prompts, int8, one thread, median of {opts.rounds} rounds"
    )
    for col in ("prompts per call", "embed ms/prompt", "read ms/prompt", "read / embed"):
        table.add_column(col)
    for size in (1, opts.batch):
        table.add_row(
            str(size), f"{cells['embed'][str(size)]:.2f}", f"{cells['read'][str(size)]:.2f}", f"{ratios[str(size)]:.3f}"
        )
    console.print(table)
    console.print(
        f"{result['with_sentences']:.0%} of the prompts have sentences (2+), "
        f"{result['mean_sentences']:.1f} on average; the language check alone: "
        f"{result['language_ms_per_prompt']:.3f} ms a prompt (inside `read`)"
    )
    report.save(console, opts.out, result)
    return result
