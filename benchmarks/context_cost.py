"""``python -m benchmarks context``: what a longer context costs the embedded default, against its
old 2,048 tokens, in the same run.

For each ``n_ctx`` a worker process opens the default's GGUF as the gateway does (a chat context and
a scorer context on the one file: ``backends.engine_host``). Then, in interleaved rounds:

- a short typed question (lettered scoring, one prefill), p50: a different one each round, so no
  size answers it from its prefix cache (the long question, asked after it, evicts it where it fits);
- a long one: a BoolQ passage from the shared data's dev rows, padded with more of its own passages
  to about ``--long-tokens`` tokens where the context holds it (what a typed question with a few
  thousand tokens of passage costs; a context too small answers 400 and is said so);
- memory: the one worker holds the file once and every context; its anonymous proportional set
  size (KV caches and compute buffers) is read after each size's two contexts open, so each
  size's cost is the step it adds (the weights, file-backed, are mapped once).

Ratios are against the first ``n_ctx`` given (2,048, the old default).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends import gguf, native
from backends.engine_handle import EngineHandle
from backends.engine_host import EngineSpec
from backends.engine_wire import question_to_wire
from benchmarks.engines import QUESTIONS, pss_kib
from policies.cascade import Question
from policies.errors import TriageError

SHORT = Question("yes_no", "Is Paris the capital of France?", ("yes", "no"))


def long_question(data: Path, tokens: int) -> Question:
    """A BoolQ dev question whose passage is padded with other dev passages to about ``tokens``
    tokens (4 characters a token)."""
    with gzip.open(data / "typed" / "boolq.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    dev = [r for r in rows if r.get("split") == "dev" and r.get("context")] or rows
    first, rest = dev[0], dev[1:]
    passage = first["context"]
    for r in rest:
        if len(passage) >= 4 * tokens:
            break
        passage = r["context"] + "\n\n" + passage
    return Question("yes_no", first["question"], ("yes", "no"), passage[-4 * tokens :])


async def measure(path: Path, sizes: list[int], rounds: int, long_q: Question, threads: int) -> dict[str, Any]:
    handles: dict[int, tuple[EngineHandle, EngineHandle]] = {}
    opened: dict[int, float] = {}
    added: dict[int, dict[str, float]] = {}
    before: dict[str, int] | None = None
    for n in sizes:
        t0 = time.perf_counter()
        chat = EngineHandle(f"chat-{n}", path, EngineSpec("chat", n, threads, 256))
        scorer = EngineHandle(f"scorer-{n}", path, EngineSpec("scorer", n, threads, 512))
        await chat.open()
        await scorer.open()
        opened[n] = time.perf_counter() - t0
        handles[n] = (chat, scorer)
        assert chat.host.pid is not None
        now = pss_kib(chat.host.pid)
        if before is not None:  # the first size's step also holds the worker's own start: not comparable
            added[n] = {k: round((now[k] - before[k]) / 1024, 1) for k in ("Pss_Anon", "Rss")}
        else:
            added[n] = {"Pss_Anon": float("nan"), "Rss": float("nan")}
            first = now
        before = now
    short: dict[int, list[float]] = {n: [] for n in sizes}
    long: dict[int, list[float]] = {n: [] for n in sizes}
    refused: dict[int, str] = {}
    for n in sizes:  # warm each
        await handles[n][1].call("score_question", {"question": question_to_wire(SHORT)}, 120)
    for r in range(rounds):
        q = QUESTIONS[r % len(QUESTIONS)]
        for n in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            scorer = handles[n][1]
            t0 = time.perf_counter()
            await scorer.call("score_question", {"question": question_to_wire(q)}, 120)
            short[n].append(time.perf_counter() - t0)
            if n in refused:
                continue
            t0 = time.perf_counter()
            try:
                await scorer.call("score_question", {"question": question_to_wire(long_q)}, 600)
            except TriageError as exc:
                refused[n] = exc.message
                continue
            long[n].append(time.perf_counter() - t0)
    for chat, scorer in handles.values():
        await chat.close()
        await scorer.close()
    return {
        "opened_s": {n: round(v, 2) for n, v in opened.items()},
        "short_p50_ms": {n: round(statistics.median(v) * 1000, 1) for n, v in short.items()},
        "long_p50_s": {n: round(statistics.median(v), 2) for n, v in long.items() if v},
        "refused": refused,
        "worker_first_mib": {k: round(v / 1024, 1) for k, v in first.items()},
        "added_mib": added,
    }


def run(package: str, sizes: list[int], rounds: int, long_tokens: int, threads: int, data: Path, out: Path) -> None:
    from benchmarks.report import save

    console = Console()
    cpu = native.cpu()
    path = gguf.model_file(package, None)
    q = long_question(data, long_tokens)
    chars = len(q.context or "")
    console.print(f"{package}: {path.name} on {cpu.model} ({cpu.kind}), {threads} thread(s); passage {chars} chars")
    res = asyncio.run(measure(path, sizes, rounds, q, threads))
    base = sizes[0]
    table = Table(title=f"the default's context: cost against n_ctx {base} ({cpu.kind}, same run)")
    for col in ("n_ctx", "open s", "short p50 ms", "ratio", "long p50 s", "two contexts add (anon PSS MiB)"):
        table.add_column(col)
    for n in sizes:
        sp, spb = res["short_p50_ms"][n], res["short_p50_ms"][base]
        long_s = res["long_p50_s"].get(n)
        step = res["added_mib"][n]["Pss_Anon"]
        table.add_row(
            str(n),
            str(res["opened_s"][n]),
            str(sp),
            f"{sp / spb:.3f}",
            f"{long_s}" if long_s is not None else f"refused: {res['refused'].get(n, '-')[:60]}",
            "(with the worker's start)" if step != step else str(step),
        )
    console.print(table)
    console.print(f"the worker after the first size: {res['worker_first_mib']} MiB")
    keyed = {k: {str(n): v for n, v in m.items()} if isinstance(m, dict) else m for k, m in res.items()}
    save(console, out, {"cpu": cpu.model, "kind": cpu.kind, "threads": threads, "package": package, **keyed})
