"""``python -m benchmarks encoder``: the encoder's latency and throughput, ONNX int8 / fp32 against PyTorch.

The contestants (ONNX int8 with each row its own forward, the default; int8 with a batch's rows in
one padded forward; int8 with ONNX Runtime's SkipLayerNormalization fusion, which the encoder turns
off; ONNX fp32; sentence-transformers on PyTorch) run in this process, in
interleaved rounds whose contestant order rotates, so that machine noise falls on each alike:
1. latency one prompt at a time, intra-op threads 1, for prompts of 16, 32, 128 and 512 tokens
   ([CLS]/[SEP] included; 512 is over the model's 256 and is truncated: head + tail for ONNX,
   head only for sentence-transformers), with the floor of this CPU beside them: the int8 export's
   matrix products alone (:mod:`benchmarks.encoder_floor`);
2. latency micro-batched: ``concurrency`` clients in a closed loop through the
   :class:`~classifiers.batching.MicroBatcher` (submit-to-result per request), threads 1;
3. decisions per second, micro-batched, at ``throughput_tokens`` tokens: on one core (intra-op
   1), on two cores (intra-op 2), and (info) two 1-thread ONNX sessions side by side;
4. agreement: cosine of int8 to fp32, of fp32 to PyTorch, and of int8 batched (rows apart and
   together) to int8 alone.
The CPU that other processes used during the run is reported: a busy machine slows every row.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks import report
from benchmarks.encoder_backends import (
    ONNX_FP32,
    ONNX_INT8,
    ONNX_INT8_SLN,
    ONNX_INT8_TOGETHER,
    PYTORCH,
    Contestant,
    Forward,
    cosine_rows,
    exact_prompts,
    onnx_contestant,
    torch_contestant,
    torch_kept_tokens,
    torch_version,
)
from benchmarks.encoder_floor import floor_contestant
from benchmarks.encoder_report import FEWER_LAYERS, goals, render
from benchmarks.meters import cpu_kind
from classifiers.artifacts import ExportSettings
from classifiers.batching import MicroBatcher
from classifiers.encoder import Encoder, EncoderSettings
from classifiers.training.export import ensure_exported

PROMPTS_PER_LENGTH = 8


@dataclass(frozen=True)
class Options:
    lengths: tuple[int, ...] = (16, 32, 128, 512)
    rounds: int = 5
    single_per_round: int = 10
    batched_per_round: int = 32
    concurrency: int = 16
    max_batch: int = 16
    max_wait_ms: float = 2.0
    throughput_tokens: int = 32
    throughput_seconds: float = 4.0
    warmup: int = 3
    torch_baseline: bool = True
    layers: tuple[int, ...] = ()  # also int8 exports that keep only the first N layers
    out: Path = Path("out/bench-encoder.json")


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its tables and write its JSON report; returns the report."""
    opts = Options(**kwargs)
    console = Console()
    console.print("exporting (or reusing) the ONNX models ...")
    art, built = ensure_exported()
    contestants = [
        onnx_contestant(ONNX_INT8, art, "int8", (1, 2)),
        onnx_contestant(ONNX_FP32, art, "fp32", (1, 2)),
        onnx_contestant(ONNX_INT8_TOGETHER, art, "int8", (1, 2), rows="together"),
        onnx_contestant(ONNX_INT8_SLN, art, "int8", (1, 2), skip_layer_norm=True),
    ]
    for n in opts.layers:
        fewer, _ = ensure_exported(settings=ExportSettings(layers=n))
        contestants.insert(1, onnx_contestant(f"{FEWER_LAYERS}{n}", fewer, "int8", (1, 2)))
    if opts.torch_baseline:
        contestants.append(torch_contestant((1, 2)))
    int8_alone = onnx_contestant("onnx-int8-b", art, "int8", (1,))
    probe = Encoder.load(EncoderSettings(), artifacts=art)
    floor = floor_contestant(art, probe, per_channel=ExportSettings().int8_per_channel)  # one prompt at a time only
    prompts = {n: exact_prompts(probe, n, PROMPTS_PER_LENGTH, seed=1) for n in opts.lengths}
    busy = _CpuMeter()
    t0 = time.perf_counter()
    for c in [*contestants, floor]:  # warm-up
        for texts in prompts.values():
            for _ in range(opts.warmup):
                c.forwards[1](texts[:1])
            c.forwards[1](texts[: min(opts.max_batch, len(texts))])
    console.print("latency, one prompt at a time ...")
    single = _single([*contestants, floor], prompts, opts)
    console.print("latency, micro-batched ...")
    batched = asyncio.run(_batched_latency(contestants, prompts, opts))
    console.print("decisions per second ...")
    tp_texts = prompts.get(opts.throughput_tokens) or exact_prompts(probe, opts.throughput_tokens, 8, seed=2)
    throughput = asyncio.run(_throughput(contestants, int8_alone, tp_texts, opts))
    agreement = _agreement(contestants, prompts)
    result: dict[str, Any] = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": {**asdict(opts), "out": str(opts.out)},
        "machine": {
            "cores": os.cpu_count(),
            "cpu": cpu_kind(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "other_processes_cpu_share": busy.other_share(),
            "seconds": time.perf_counter() - t0,
        },
        "export": {"dir": str(art.root), "built_now": built, **{k: art.manifest()[k] for k in ("key", "versions")}},
        "torch": torch_version(),
        "truncation": {
            str(n): {
                "tokens": n,
                "onnx_kept": len(probe.encode(prompts[n][0]).ids),
                "onnx_policy": "head+tail",
                "pytorch_kept": torch_kept_tokens(n),
                "pytorch_policy": "head",
            }
            for n in opts.lengths
        },
        "single": single,
        "batched": batched,
        "throughput": throughput,
        "agreement": agreement,
    }
    result["goals"] = goals(result)
    render(console, result)
    report.save(console, opts.out, result)
    return result


def _rotated(items: Sequence[Contestant], r: int) -> list[Contestant]:
    k = r % len(items)
    return [*items[k:], *items[:k]]


def _stats(samples: list[float]) -> dict[str, float | int]:
    ms = np.asarray(samples) * 1000.0
    return {
        "n": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def _single(contestants: list[Contestant], prompts: dict[int, list[str]], opts: Options) -> dict[str, Any]:
    samples: dict[str, dict[int, list[float]]] = {c.name: {n: [] for n in prompts} for c in contestants}
    for r in range(opts.rounds):
        for c in _rotated(contestants, r):
            fwd = c.forwards[1]
            for n, texts in prompts.items():
                for i in range(opts.single_per_round):
                    text = texts[(r * opts.single_per_round + i) % len(texts)]
                    t = time.perf_counter()
                    fwd([text])
                    samples[c.name][n].append(time.perf_counter() - t)
            c.settle(1)
    return {name: {str(n): _stats(s) for n, s in by.items()} for name, by in samples.items()}


async def _closed_loop(
    batcher: MicroBatcher[str, np.ndarray],
    texts: list[str],
    clients: int,
    *,
    requests: int | None = None,
    seconds: float | None = None,
) -> tuple[list[float], float]:
    lat: list[float] = []
    stop = time.perf_counter() + seconds if seconds is not None else None
    issued = 0

    async def client(k: int) -> None:
        nonlocal issued
        while (requests is None or issued < requests) and (stop is None or time.perf_counter() < stop):
            issued += 1
            text = texts[(issued + k) % len(texts)]
            t = time.perf_counter()
            await batcher.embed(text)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return lat, time.perf_counter() - t0


async def _batched_latency(
    contestants: list[Contestant], prompts: dict[int, list[str]], opts: Options
) -> dict[str, Any]:
    samples: dict[str, dict[int, list[float]]] = {c.name: {n: [] for n in prompts} for c in contestants}
    sizes: dict[str, list[int]] = {c.name: [] for c in contestants}
    for r in range(opts.rounds):
        for c in _rotated(contestants, r):
            async with MicroBatcher(c.forwards[1], max_batch=opts.max_batch, max_wait_ms=opts.max_wait_ms) as b:
                for n, texts in prompts.items():
                    lat, _ = await _closed_loop(b, texts, opts.concurrency, requests=opts.batched_per_round)
                    samples[c.name][n].extend(lat)
            sizes[c.name].extend(b.stats.sizes)
            c.settle(1)
    return {
        name: {**{str(n): _stats(s) for n, s in by.items()}, "mean_batch": float(np.mean(sizes[name]))}
        for name, by in samples.items()
    }


async def _rate(forwards: list[Forward], texts: list[str], opts: Options, seconds: float) -> tuple[int, float, float]:
    batchers = [MicroBatcher(f, max_batch=opts.max_batch, max_wait_ms=opts.max_wait_ms) for f in forwards]
    clients = 2 * opts.max_batch
    try:
        results = await asyncio.gather(
            *(_closed_loop(b, texts, clients // len(batchers), seconds=seconds) for b in batchers)
        )
    finally:
        for b in batchers:
            await b.aclose()
    done = sum(len(lat) for lat, _ in results)
    elapsed = max(e for _, e in results)
    mean_batch = float(np.mean([s for b in batchers for s in b.stats.sizes]))
    return done, elapsed, mean_batch


async def _throughput(
    contestants: list[Contestant], int8_alone: Contestant, texts: list[str], opts: Options
) -> dict[str, Any]:
    cells: list[tuple[str, Contestant, list[Forward], int]] = []
    for c in contestants:
        cells += [(f"{c.name}|1", c, [c.forwards[1]], 1), (f"{c.name}|2", c, [c.forwards[2]], 2)]
    pair = next(c for c in contestants if c.name == ONNX_INT8)
    cells.append(("onnx-int8-2x1|2", pair, [pair.forwards[1], int8_alone.forwards[1]], 1))
    totals: dict[str, list[float]] = {key: [0.0, 0.0, 0.0] for key, *_ in cells}
    rounds = max(1, min(opts.rounds, 2))
    for r in range(rounds):
        k = r % len(cells)
        for key, c, fwds, threads in [*cells[k:], *cells[:k]]:
            done, elapsed, mean_batch = await _rate(fwds, texts, opts, opts.throughput_seconds / rounds)
            totals[key][0] += done
            totals[key][1] += elapsed
            totals[key][2] += mean_batch / rounds
            c.settle(threads)
    out: dict[str, Any] = {}
    for key, (count, seconds, batch) in totals.items():
        name, cores = key.split("|")
        out.setdefault(name, {})[cores] = {"decisions_per_s": count / seconds, "n": int(count), "mean_batch": batch}
    out["tokens"] = opts.throughput_tokens
    return out


def _agreement(contestants: list[Contestant], prompts: dict[int, list[str]]) -> dict[str, Any]:
    texts = [t for n in sorted(prompts) for t in prompts[n]]
    by = {c.name: c for c in contestants}
    one = {name: np.stack([by[name].forwards[1]([t])[0] for t in texts]) for name in by}
    out: dict[str, Any] = {"n": len(texts)}

    def pair(key: str, a: np.ndarray, b: np.ndarray) -> None:
        cos = cosine_rows(a, b)
        out[key] = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min())}

    pair("int8_vs_fp32", one[ONNX_INT8], one[ONNX_FP32])
    batched = np.concatenate([by[ONNX_INT8].forwards[1](prompts[n]) for n in sorted(prompts)])
    pair("int8_batched_vs_int8_alone", batched, one[ONNX_INT8])  # rows apart: 1.0
    together = np.concatenate([by[ONNX_INT8_TOGETHER].forwards[1](prompts[n]) for n in sorted(prompts)])
    pair("int8_together_batched_vs_int8_alone", together, one[ONNX_INT8])
    short = [i for i, t in enumerate(texts) if len(t.split()) + 2 <= 256]
    if PYTORCH in one:  # the 512-token prompts are truncated differently (head+tail vs head)
        pair("fp32_vs_pytorch", one[ONNX_FP32][short], one[PYTORCH][short])
        pair("int8_vs_pytorch", one[ONNX_INT8][short], one[PYTORCH][short])
    return out


class _CpuMeter:
    """CPU time that other processes used since creation, as a share of all cores (Linux /proc/stat)."""

    def __init__(self) -> None:
        self._start = self._read()
        self._own = time.process_time()
        self._wall = time.perf_counter()

    @staticmethod
    def _read() -> float | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def other_share(self) -> float | None:
        end = self._read()
        if end is None or self._start is None:
            return None
        other = (end - self._start) - (time.process_time() - self._own)
        return max(0.0, other / ((time.perf_counter() - self._wall) * (os.cpu_count() or 1)))
