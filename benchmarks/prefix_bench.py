"""``python -m benchmarks prefix``: arrival order against sorted against grouped, on real engines, in one run.

The batch is BIG-Bench-Hard few-shot prompts (27 templates), shuffled with a fixed seed: that is
the arrival order. SORTED is a plain lexicographic sort of the prompt texts; GROUPED is
:func:`backends.prefix.plan` over the model's own tokens. Each order goes, from a cold cache, to:

- ``server``: a real llama.cpp server (``python -m llama_cpp.server``, SmolLM2-135M, one slot that
  keeps the previous prompt), one ``/v1/completions`` request per prompt with ``max_tokens=1``.
  The prompt tokens it really evaluated are llama.cpp's own count, read from its verbose log
  (``llama_perf_context_print: prompt eval time = ... / N tokens``, one line per request);
- ``scorer``: the in-process GGUF option scorer (:class:`backends.logprob.OptionScorer`) scoring
  the row's answer as the continuation; evaluated = ``prompt_tokens - reused_tokens``;
- ``vllm`` (not in the default set; ``make vllm`` builds it): a real vLLM engine (its CPU build,
  SmolLM2-135M as safetensors), the same requests as ``server``, ``concurrency`` in flight, its
  prefix cache emptied before each order (``POST /reset_prefix_cache``). Evaluated tokens are
  vLLM's own counters: ``vllm:prompt_tokens_total - vllm:prefix_cache_hits_total``. vLLM caches
  whole KV blocks (``vllm_block_size``) and keeps every block it can (not only the last prompt,
  as llama.cpp's slot): with a cache that holds the batch's templates (``vllm_cache_tokens=0``,
  1 GiB) the order barely matters; with a cache smaller than the batch's working set, it does.

Reported per order: wall time, requests/s, prompt tokens, evaluated tokens, reuse achieved and as
a share of the ideal (:func:`backends.prefix.ideal_reuse` over the batch), ratios against arrival;
and the scheduler's own cost per request (tokenization + plan) with the tokens the Batch API can
group by: SmolLM2's GGUF vocabulary on every prompt whole, the same with the shared prefixes
tokenized once (:func:`backends.tokens.tokenize_batch`, what the Batch API does), and
:func:`backends.prefix.approx_tokens`. The engines run one at a time, one thread each;
``engines=()`` measures the scheduler alone.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from backends import tokens as tokens_mod
from backends.gguf import smollm2_path
from backends.prefix import Group, Item, approx_tokens, flatten, ideal_reuse, plan, reuse_in_order
from benchmarks import meters, report
from benchmarks import vllm as vllm_engine
from benchmarks.overhead import machine
from benchmarks.procs import HOST, Fleet, Proc, StartFailed, child_env, free_port

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "prefix" / "bbh_fewshot_direct.jsonl.gz"
ORDERS = ("arrival", "sorted", "grouped")
ENGINES = ("server", "scorer")  # the default set
ALL_ENGINES = (*ENGINES, "vllm")
TOKENS = ("model", "cached", "approx")  # SmolLM2's vocabulary whole, the same prefix-cached, approx_tokens
RESET_PROMPT = "Hello."  # sent before each order: the cache then holds nothing the batch can use
REUSE_SHARE_MIN = 0.9
SPEEDUP_MIN = 3.0
VLLM_REUSE_SHARE_MIN = 0.95  # issue 19's goals on vLLM
VLLM_SPEEDUP_MIN = 2.0
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
SCHEDULER_MAX_MS = 0.2
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
_PREFIX_HIT = re.compile(r"(\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")


@dataclass(frozen=True)
class Options:
    data: Path = DATA
    limit: int = 300
    templates: int = 0  # 0: every template; else rows of this many templates (drawn with the seed)
    seed: int = 0
    min_shared: int = 16
    engines: tuple[str, ...] = ENGINES
    n_threads: int = 1
    concurrency: int = 1
    group_by: str = "model"  # tokens the grouping uses: one of TOKENS
    repeats: int = 5  # timings of the scheduler: the median of this many runs
    vllm_block_size: int = 32  # tokens per KV block (vLLM's CPU default is 128; it prefers multiples of 32)
    vllm_cache_tokens: int = 0  # KV cache size in tokens; 0: vLLM's own (1 GiB, about 46k tokens)
    out: Path = Path("out/bench-prefix.json")


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its tables and write its JSON report; returns the report."""
    from benchmarks.prefix_report import render  # the report imports this module's constants

    opts = Options(**kwargs)
    bad = set(opts.engines) - set(ALL_ENGINES)
    if bad or opts.group_by not in TOKENS:
        raise ValueError(f"engines are {', '.join(ALL_ENGINES)}; group_by is one of {', '.join(TOKENS)}")
    console = Console()
    rows = load(opts)
    console.print(
        f"[bold]batch[/]: {len(rows)} prompts from {opts.data.name}, "
        f"{len({r['group'] for r in rows})} templates, seed {opts.seed}"
    )
    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {**asdict(opts), "data": str(opts.data), "out": str(opts.out)},
    }
    sched = scheduler(rows, opts)
    result["scheduler"] = sched.pop("summary")
    tokens, orders = sched["tokens"], sched["orders"]
    n_ctx = -(-(max(map(len, tokens)) + 16) // 256) * 256  # tokens: with the BOS the engines add
    result["batch"] = {
        "n": len(rows),
        "templates": len({r["group"] for r in rows}),
        "n_ctx": n_ctx,
        "prompt_tokens": sum(map(len, tokens)),
        "max_prompt_tokens": max(map(len, tokens)),
        "ideal_reuse": ideal_reuse(tokens),
        "predicted_reuse": {o: reuse_in_order([tokens[k] for k in orders[o]]) for o in ORDERS},
    }
    result["engines"] = {}
    with tempfile.TemporaryDirectory(prefix="triage-bench-prefix-") as tmp:
        for engine in opts.engines:
            console.print(f"[bold]{engine}[/]: {', '.join(ORDERS)}, {len(rows)} requests each")
            measure = {"server": _server, "scorer": _scorer, "vllm": _vllm}[engine]
            result["engines"][engine] = measure(rows, orders, n_ctx, opts, Path(tmp), console)
    _ratios(result)
    result["goals"] = goals(result)
    render(console, result)
    report.save(console, opts.out, result)
    return result


def load(opts: Options) -> list[dict[str, Any]]:
    with gzip.open(opts.data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rng = random.Random(opts.seed)
    if opts.templates:
        groups = sorted({r["group"] for r in rows})
        keep = set(rng.sample(groups, min(opts.templates, len(groups))))
        rows = [r for r in rows if r["group"] in keep]
    rng.shuffle(rows)
    return rows[: opts.limit]


def _median_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), out


def scheduler(rows: list[dict[str, Any]], opts: Options) -> dict[str, Any]:
    """Tokenize and plan with each of TOKENS, timed; the three orders (GROUPED from ``group_by``).
    Every grouping is judged on SmolLM2's tokens as the engines see them (a BOS first)."""
    import llama_cpp

    prompts, path = [r["prompt"] for r in rows], smollm2_path()
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    model_tokens = [tuple(llm.tokenize(p.encode("utf-8"), add_bos=True, special=False)) for p in prompts]
    llm.close()
    vocab = tokens_mod.load(path)  # the Batch API's tokenizer of SmolLM2
    tokenizers: dict[str, Callable[[], list[tuple[int, ...]]]] = {
        "model": lambda: tokens_mod.tokenize_batch(prompts, vocab.tokenize, prefix_cache=False),
        "cached": lambda: tokens_mod.tokenize_batch(prompts, vocab.tokenize, prefix_cache=vocab.splits_at_spaces),
        "approx": lambda: [approx_tokens(p) for p in prompts],
    }
    n, summary, groupings, lists = len(rows), {}, {}, {}
    for name, tok in tokenizers.items():
        tok_ms, toks = _median_ms(tok, opts.repeats)
        plan_ms, groups = _median_ms(lambda toks=toks: _plan(toks, opts.min_shared), opts.repeats)
        lists[name], groupings[name] = toks, groups
        summary[name] = {
            "tokenize_ms_per_req": tok_ms / n,
            "plan_ms_per_req": plan_ms / n,
            "total_ms_per_req": (tok_ms + plan_ms) / n,
            "groups": len(groups),
            "tokens_per_prompt": sum(map(len, toks)) / n,
            "own_ideal_reuse": ideal_reuse(toks),
        }
    for name, groups in groupings.items():  # how good each grouping is, counted in the engines' tokens
        summary[name]["predicted_reuse"] = reuse_in_order([model_tokens[k] for k in flatten(groups)])
        same = sum(a == b for a, b in zip(lists[name], lists["model"], strict=True))
        summary[name]["same_tokens_as_model"] = same / n
        summary[name]["same_groups_as_model"] = [g.keys for g in groups] == [g.keys for g in groupings["model"]]
    summary["model"]["tokenizer"] = f"backends.tokens (llama.cpp vocab_only) on {path.name}, each prompt whole"
    summary["cached"]["tokenizer"] = f"backends.tokens.tokenize_batch on {path.name}, shared prefixes once" + (
        "" if vocab.splits_at_spaces else " (off: the vocabulary does not split at spaces)"
    )
    summary["approx"]["tokenizer"] = "backends.prefix.approx_tokens"
    summary["used"] = opts.group_by
    orders = {
        "arrival": list(range(n)),
        "sorted": sorted(range(n), key=prompts.__getitem__),
        "grouped": flatten(groupings[opts.group_by]),
    }
    return {"summary": summary, "tokens": model_tokens, "orders": orders}


def _plan(tokens: list[tuple[int, ...]], min_shared: int) -> list[Group]:
    items = [Item(i, t, decode=1) for i, t in enumerate(tokens)]  # max_tokens=1: every decode alike
    return plan(items, min_shared=min_shared, order="decode_ratio")  # as the figures in the docs were taken


def _server(
    rows: list[dict[str, Any]], orders: dict[str, list[int]], n_ctx: int, opts: Options, tmp: Path, console: Console
) -> dict[str, Any]:
    return asyncio.run(_server_main(rows, orders, n_ctx, opts, tmp, console))


async def _server_main(
    rows: list[dict[str, Any]], orders: dict[str, list[int]], n_ctx: int, opts: Options, tmp: Path, console: Console
) -> dict[str, Any]:
    port, threads = free_port(), str(opts.n_threads)
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_path()),
        "--model_alias",
        "smollm2",
        "--host",
        HOST,
        "--port",
        str(port),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
        "--verbose",
        "True",
    ]
    out: dict[str, Any] = {"argv": argv[1:], "orders": {}}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        with Fleet(tmp) as fleet:
            proc = fleet.add(Proc("llama-server", argv, port, "/v1/models", tmp / "llama-server.log"))
            await proc.wait_ready(http, 180)
            for name in ORDERS:
                others = meters.foreign({"llama-server": proc})
                row = await _server_order(http, proc, [rows[k]["prompt"] for k in orders[name]], opts.concurrency)
                row["other_cpu_cores"] = others()
                out["orders"][name] = row
                console.print(f"  {name}: {row['wall_s']:.1f} s, {row['evaluated_tokens']} tokens evaluated")
    return out


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    async with http.post(url, json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"llama.cpp server answered {r.status}: {str(data)[:300]}")
    return int(data["usage"]["prompt_tokens"])


async def _send_all(http: aiohttp.ClientSession, url: str, prompts: list[str], concurrency: int) -> dict[str, Any]:
    """Every prompt, in order, ``concurrency`` in flight: wall time, requests/s, prompt tokens."""
    gate = asyncio.Semaphore(concurrency)

    async def one(p: str) -> int:
        async with gate:
            return await _complete(http, url, p)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "rps": len(prompts) / wall, "prompt_tokens": sum(counts)}


async def _server_order(
    http: aiohttp.ClientSession, proc: Proc, prompts: list[str], concurrency: int
) -> dict[str, Any]:
    url = proc.base + "/v1/completions"
    await _complete(http, url, RESET_PROMPT)
    start = proc.log_path.stat().st_size
    row = await _send_all(http, url, prompts, concurrency)
    evaluated, hits = await _parse_log(proc.log_path, start, len(prompts))
    return {**row, "evaluated_tokens": evaluated, "prefix_hits": hits}


def _vllm(
    rows: list[dict[str, Any]], orders: dict[str, list[int]], n_ctx: int, opts: Options, tmp: Path, console: Console
) -> dict[str, Any]:
    return asyncio.run(_vllm_main(rows, orders, n_ctx, opts, tmp, console))


async def _vllm_main(
    rows: list[dict[str, Any]], orders: dict[str, list[int]], n_ctx: int, opts: Options, tmp: Path, console: Console
) -> dict[str, Any]:
    if (reason := vllm_engine.missing()) is not None:
        raise StartFailed(reason)
    port = free_port()
    cache = vllm_engine.cache_args(opts.vllm_block_size, opts.vllm_cache_tokens)
    argv = vllm_engine.argv(port, max_model_len=max(n_ctx, 256), extra=cache)
    env = vllm_engine.env(child_env(), cpu=0, dev=True)
    out: dict[str, Any] = {"argv": argv[1:], "orders": {}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        with Fleet(tmp) as fleet:
            proc = fleet.add(Proc("vllm", argv, port, vllm_engine.READY_PATH, tmp / "vllm.log", env=env))
            await proc.wait_ready(http, vllm_engine.START_TIMEOUT_S)
            url = proc.base + "/v1/completions"
            await _complete(http, url, RESET_PROMPT)  # the first request's own costs, outside the orders
            for name in ORDERS:
                async with http.post(proc.base + "/reset_prefix_cache") as r:
                    if r.status != 200:
                        raise RuntimeError(f"vLLM did not empty its prefix cache: HTTP {r.status}")
                before = await _vllm_counters(http, proc)
                others = meters.foreign({"vllm": proc})
                row = await _send_all(http, url, [rows[k]["prompt"] for k in orders[name]], opts.concurrency)
                row["other_cpu_cores"] = others()
                after = await _vllm_counters(http, proc)
                seen, hits, _ = (after[c] - before[c] for c in VLLM_COUNTERS)
                row.update(engine_prompt_tokens=int(seen), prefix_hits=int(hits), evaluated_tokens=int(seen - hits))
                row["prompt_tokens"] = int(seen)  # the engine's own count, so reuse is hits over it
                out["orders"][name] = row
                console.print(f"  {name}: {row['wall_s']:.1f} s, {row['evaluated_tokens']} tokens evaluated")
    return out


async def _vllm_counters(http: aiohttp.ClientSession, proc: Proc) -> dict[str, float]:
    async with http.get(proc.base + "/metrics") as r:
        return vllm_engine.counters(await r.text(), VLLM_COUNTERS)


async def _parse_log(path: Path, start: int, n: int) -> tuple[int | None, int]:
    """llama.cpp's count of evaluated prompt tokens, one line per request, from ``start`` on."""
    for _ in range(50):  # the server prints before it answers; wait a little for the file anyway
        with path.open("rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        evals = [int(m) for m in _PROMPT_EVAL.findall(text)]
        if len(evals) >= n:
            return sum(evals[:n]), len(_PREFIX_HIT.findall(text))
        await asyncio.sleep(0.1)
    return None, len(_PREFIX_HIT.findall(text))  # the log does not say: no number rather than a wrong one


def _scorer(
    rows: list[dict[str, Any]], orders: dict[str, list[int]], n_ctx: int, opts: Options, tmp: Path, console: Console
) -> dict[str, Any]:
    from backends.logprob import OptionScorer

    scorer = OptionScorer(smollm2_path(), n_ctx=n_ctx, n_threads=opts.n_threads)
    out: dict[str, Any] = {"continuation": "' ' + the row's answer", "orders": {}}
    try:
        for name in ORDERS:
            scorer.score(RESET_PROMPT, [" A"])
            others = meters.foreign({})
            prompt_tokens = reused = 0
            t0 = time.perf_counter()
            for k in orders[name]:
                s = scorer.score(rows[k]["prompt"], [" " + str(rows[k]["answer"])])
                prompt_tokens += s.prompt_tokens
                reused += s.reused_tokens
            wall = time.perf_counter() - t0
            out["orders"][name] = {
                "wall_s": wall,
                "rps": len(orders[name]) / wall,
                "prompt_tokens": prompt_tokens,
                "evaluated_tokens": prompt_tokens - reused,
                "other_cpu_cores": others(),
            }
            console.print(f"  {name}: {wall:.1f} s, {prompt_tokens - reused} tokens evaluated")
    finally:
        scorer.close()
    return out


def _ratios(result: dict[str, Any]) -> None:
    ideal = result["batch"]["ideal_reuse"]
    for eng in result["engines"].values():
        base = eng["orders"]["arrival"]
        for row in eng["orders"].values():
            ev = row["evaluated_tokens"]
            row["reuse"] = None if ev is None else 1 - ev / row["prompt_tokens"]
            row["share_of_ideal"] = None if row["reuse"] is None or ideal <= 0 else row["reuse"] / ideal
            row["rps_x_arrival"] = row["rps"] / base["rps"]
            row["evaluated_x_arrival"] = (
                None if ev is None or not base["evaluated_tokens"] else ev / base["evaluated_tokens"]
            )


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, eng in res["engines"].items():
        g = eng["orders"]["grouped"]
        share, speed = g["share_of_ideal"], g["rps_x_arrival"]
        share_min, speed_min = (
            (VLLM_REUSE_SHARE_MIN, VLLM_SPEEDUP_MIN) if name == "vllm" else (REUSE_SHARE_MIN, SPEEDUP_MIN)
        )
        rows.append(
            {
                "goal": f"{name}: grouped reuse >= {share_min:.0%} of the ideal",
                "value": share,
                "unit": "",
                "pass": None if share is None else share >= share_min,
            }
        )
        rows.append(
            {
                "goal": f"{name}: grouped throughput >= {speed_min:g}x arrival",
                "value": speed,
                "unit": "x",
                "pass": speed >= speed_min,
            }
        )
    used = res["scheduler"]["used"]
    for tok in TOKENS:
        ms = res["scheduler"][tok]["total_ms_per_req"]
        tag = "" if tok == used else "(info) "
        rows.append(
            {
                "goal": f"{tag}scheduler ({tok} tokens + plan) <= {SCHEDULER_MAX_MS} ms/request",
                "value": ms,
                "unit": "ms",
                "pass": None if tag else ms <= SCHEDULER_MAX_MS,
            }
        )
    return rows
