"""Local engines in a worker process against in-process, in the same run; recovery after a crash;
what the weights cost in memory.

- **Decisions**: lettered scoring of the same questions through the worker
  (``backends.engine_host``, what the gateway does now) and through a ``ChatScorer`` in this
  process on a worker thread (what it did before), in interleaved rounds: p50 per decision, ratio.
- **Chat**: tokens per second of one greedy completion, the same way.
- **Recovery**: the worker is killed (SIGKILL, as a fault would end it) while idle; the time until a
  request is answered again, p50 over the kills.
- **Memory**: the worker's proportional set size (``/proc/PID/smaps_rollup``: file-backed pages,
  the mapped weights, are shared with every process that maps the file; anonymous pages are its
  own), with a chat and a scorer context on the one file, against the file's size.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends import gguf, native
from backends.engine_handle import EngineHandle
from backends.engine_host import EngineSpec, Host
from backends.engine_wire import question_to_wire
from policies.cascade import Question

QUESTIONS = [
    Question("choice", "Which planet is known as the red planet?", ("Venus", "Mars", "Jupiter", "Saturn")),
    Question("yes_no", "Is water wet?", ("yes", "no")),
    Question("choice", "What is 7 times 8?", ("54", "56", "58", "64")),
    Question("yes_no", "Can penguins fly?", ("yes", "no")),
    Question("choice", "Which gas do plants take from the air?", ("oxygen", "nitrogen", "carbon dioxide", "helium")),
    Question("yes_no", "Is Paris the capital of France?", ("yes", "no")),
]
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def pss_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
            out[key] = int(rest.split()[0])
    return out


async def _ready(handle: EngineHandle, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not handle.healthy():
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine did not come back: {handle.problem()}")
        await asyncio.sleep(0.01)


async def measure(path: Path, rounds: int, tokens: int, kills: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    from backends.lettered import ChatScorer

    scorer = ChatScorer(path, 2048, threads, 512)
    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    chat_h = EngineHandle("chat", path, EngineSpec("chat", 2048, threads, 256))
    score_h = EngineHandle("scorer", path, EngineSpec("scorer", 2048, threads, 512))
    await chat_h.open()
    await score_h.open()
    host: Host = chat_h.host
    times: dict[str, list[float]] = {"in-process": [], "worker": []}
    rates: dict[str, list[float]] = {"in-process": [], "worker": []}
    args = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0}
    for q in QUESTIONS:  # warm both
        await asyncio.to_thread(scorer.score_question, q)
        await score_h.call("score_question", {"question": question_to_wire(q)}, 60)
    for r in range(rounds):
        order = ["in-process", "worker"] if r % 2 == 0 else ["worker", "in-process"]
        for row in order:
            for q in QUESTIONS:
                t0 = time.perf_counter()
                if row == "worker":
                    await score_h.call("score_question", {"question": question_to_wire(q)}, 60)
                else:
                    await asyncio.to_thread(scorer.score_question, q)
                times[row].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if row == "worker":
                body = await chat_h.call("completion", args, 300)
            else:
                body = await asyncio.to_thread(llm.create_completion, PROMPT, max_tokens=tokens, temperature=0.0)
            rates[row].append(body["usage"]["completion_tokens"] / (time.perf_counter() - t0))
    assert host.pid is not None
    memory = pss_kib(host.pid)
    recovery: list[float] = []
    for _ in range(kills):
        pid = host.pid
        assert pid is not None
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while host.pid in (pid, None) or not score_h.healthy():
            await asyncio.sleep(0.01)
        await score_h.call("score_question", {"question": question_to_wire(QUESTIONS[0])}, 60)
        recovery.append(time.perf_counter() - t0)
    await chat_h.close()
    await score_h.close()
    scorer.close()
    llm.close()
    p50 = {row: statistics.median(v) for row, v in times.items()}
    tps = {row: statistics.median(v) for row, v in rates.items()}
    return {
        "model": path.name,
        "file_mib": round(path.stat().st_size / 2**20, 1),
        "decision_p50_ms": {k: round(v * 1000, 2) for k, v in p50.items()},
        "decision_ratio": round(p50["worker"] / p50["in-process"], 4),
        "chat_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "chat_ratio": round(tps["worker"] / tps["in-process"], 4),
        "recovery_s": [round(x, 3) for x in recovery],
        "recovery_p50_s": round(statistics.median(recovery), 3) if recovery else None,
        "worker_memory_mib": {k: round(v / 1024, 1) for k, v in memory.items()},
    }


def run(models: list[str], rounds: int, tokens: int, kills: int, threads: int, out: Path) -> None:
    from benchmarks.report import save

    console = Console()
    cpu = native.cpu()
    results = []
    for package in models:
        path = gguf.model_file(package, None)
        console.print(f"{package}: {path.name} on {cpu.model} ({cpu.kind})")
        results.append(asyncio.run(measure(path, rounds, tokens, kills, threads)))
    table = Table(title=f"local engines: worker process against in-process ({cpu.kind}, {threads} thread)")
    for col in ("model", "decision p50 in-proc", "worker", "ratio", "chat tok/s in-proc", "worker", "ratio"):
        table.add_column(col)
    table.add_column("recovery p50")
    table.add_column("worker PSS (anon + file)")
    for r in results:
        d, c, m = r["decision_p50_ms"], r["chat_tokens_per_s"], r["worker_memory_mib"]
        table.add_row(
            r["model"],
            f"{d['in-process']} ms",
            f"{d['worker']} ms",
            f"{r['decision_ratio']:.3f}",
            f"{c['in-process']}",
            f"{c['worker']}",
            f"{r['chat_ratio']:.3f}",
            f"{r['recovery_p50_s']} s",
            f"{m.get('Pss')} MiB ({m.get('Pss_Anon')} + {m.get('Pss_File')}); file {r['file_mib']} MiB",
        )
    console.print(table)
    save(console, out, {"cpu": cpu.model, "kind": cpu.kind, "threads": threads, "results": results})
