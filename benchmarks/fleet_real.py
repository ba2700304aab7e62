"""``python -m benchmarks fleet-real``: the dispatch rule (``strategy: prefix``) on real engines, against
round robin, least load and the admission window, in one run.

Two vLLM engines (CPU build, SmolLM2-135M, one core each, KV caches of ``--cache-tokens`` in blocks of
``--block-tokens``: small against the workload, so placement matters) start once. For each workload
and mode their prefix caches are emptied and TWO ``triage serve`` gateways start on one policy in
front of both, with a real ``redis-server`` as their state store (a key prefix per mode): under
``prefix`` they share their prefix index through it (``backends/index_feed.py``). The workload goes
through the two gateways alternately (official ``openai`` client, streamed chat, ``--concurrency`` in
flight, small ``max_tokens``: prefill dominates). Modes: ``round_robin``; ``least_load`` and
``prefix`` (``dispatch: {engine: vllm}``: each gateway polls both engines' /metrics); ``admission``
(the older waiting room, strategy round_robin). Workloads (``--seed``): ``fewshot`` (BBH chain-of-
thought few-shot prompts of ``--templates`` templates, shuffled), ``system`` (one long system prompt
of real text, a BBH template's exemplars, before distinct MT-Bench / Arena-Hard questions),
``distinct`` (Arena-Hard questions after a unique id: no shared prefix). Reported: requests/s,
tokens/s, TTFT (first content chunk) and latency p50/p99, the engines' own prefix-cache hit rate and
requests per replica (their counters' deltas), ratios against round robin; under ``prefix``, how the
two gateways placed each prompt start (the shared feed, read back from Redis); the issue's goals.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from backends.engine_load import parse as parse_engine_load
from benchmarks import meters, report
from benchmarks import prefix_bench as prefix
from benchmarks import vllm as vllm_engine
from benchmarks.affinity import reset_caches, start_gateway, start_vllm_pool
from benchmarks.overhead import machine
from benchmarks.procs import HOST, Fleet, Proc, StartFailed, start_redis

DATA = prefix.DATA.parents[1]  # the shared data folder
MODES = ("round_robin", "least_load", "admission", "prefix")
WORKLOADS = ("fewshot", "system", "distinct")
PREFIX_HEAVY = ("fewshot", "system")
MODEL = vllm_engine.MODEL
MAX_MODEL_LEN = 4096  # the gateway's fit check estimates a prompt at bytes / 3 tokens: room for the system workload
FEWSHOT_MAX_CHARS = 4000  # templates whose prompts fit max_model_len with room (about 1,200 tokens)
FEWSHOT_MIN_SHARED = 1500  # and share at least this many characters (several KV blocks)
SYSTEM_GROUP = "bbh-cot/salient_translation_error_detection"  # the system prompt's text (about 1,500 tokens)
DISTINCT_CHARS = (300, 3000)  # Arena-Hard questions of this length: prefill still counts, all fit
LOG_EVENTS = ("engine_signals_unknown", "index_feed_failed", "index_feed_item_malformed")  # the dispatch's warnings
RPS_MIN, TTFT_MAX, LEAST_LOAD_TOL = 1.5, 0.5, 0.05  # the goals
SYSTEM_HEAD = "You are a careful assistant. Reason as the worked examples below do, then answer briefly.\n\n"
COUNTERS = (
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:request_success_total", "vllm:num_preemptions_total",
)  # fmt: skip

Messages = list[Any]  # chat messages: {role, content}
Counts = dict[str, float]


@dataclass(frozen=True)
class Options:
    data: Path = DATA
    requests: int = 96
    templates: int = 6
    concurrency: int = 8
    max_tokens: int = 8
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    modes: tuple[str, ...] = MODES
    block_tokens: int = 128  # vLLM's CPU build caches KV in blocks of 128 tokens (docs/vllm.md)
    cache_tokens: int = 4096  # each engine's KV cache
    interval_s: float = 0.25  # dispatch.interval_s: the engines' /metrics read this often
    admission: str = "slots: 8, cached_prompts: 16, max_skips: 8, window_ms: 50"
    out: Path = Path("out/fleet-real.json")


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its tables and write its JSON report; returns the report."""
    opts = Options(**kwargs)
    if min(opts.requests, opts.concurrency, opts.max_tokens, opts.templates) < 1:
        raise ValueError("requests, concurrency, max_tokens and templates must be at least 1")
    if "round_robin" not in opts.modes or not {*opts.modes} <= {*MODES} or not {*opts.workloads} <= {*WORKLOADS}:
        raise ValueError(f"modes: some of {MODES}, round_robin among them; workloads: some of {WORKLOADS}")
    if (why := vllm_engine.missing()) is not None:
        raise StartFailed(why)
    console = Console()
    loads = {w: workload(w, opts) for w in opts.workloads}
    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {**asdict(opts), "data": str(opts.data), "out": str(opts.out)},
        "workloads": {w: describe(items) for w, items in loads.items()},
    }
    for w, d in result["workloads"].items():
        console.print(f"[bold]{w}[/]: {d['n']} requests, {d['prompt_chars']:,} prompt characters, {d['note']}")
    with tempfile.TemporaryDirectory(prefix="triage-fleet-real-") as tmp:
        asyncio.run(_main(loads, opts, Path(tmp), console, result))
    _ratios(result["runs"])
    result["goals"] = goals(result["runs"])
    render(console, result)
    report.save(console, opts.out, result)
    return result


# -- workloads -------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict[str, Any]]:
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def workload(name: str, opts: Options) -> list[tuple[str, Messages]]:
    """(prefix group, chat messages) per request, in arrival order."""
    rng = random.Random(f"{opts.seed}:{name}")
    bbh = _jsonl(opts.data / "prefix" / "bbh_fewshot_cot.jsonl.gz")
    arena = [r["prompt"] for r in _jsonl(opts.data / "open" / "arena_hard_v0.1.jsonl")]
    if name == "fewshot":
        by: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in bbh:
            by[r["group"]].append(r)
        fit = _templates(by)
        picked = [r for g in rng.sample(fit, min(opts.templates, len(fit))) for r in by[g]]
        rng.shuffle(picked)
        return [(r["group"], [{"role": "user", "content": r["prompt"]}]) for r in picked[: opts.requests]]
    if name == "system":
        row = next(r for r in bbh if r["group"] == SYSTEM_GROUP)
        system = {"role": "system", "content": SYSTEM_HEAD + row["prompt"][: row["prefix_chars"]]}
        mt = [r["prompt"] for r in _jsonl(opts.data / "open" / "mt_bench.jsonl")]
        questions = sorted({*mt, *(q for q in arena if len(q) <= 400)})
        rng.shuffle(questions)
        return [("system", [system, {"role": "user", "content": q}]) for q in questions[: opts.requests]]
    questions = sorted({q for q in arena if DISTINCT_CHARS[0] <= len(q) <= DISTINCT_CHARS[1]})
    rng.shuffle(questions)
    return [
        (f"q{i}", [{"role": "user", "content": f"[request {rng.getrandbits(48):012x}] {q}"}])
        for i, q in enumerate(questions[: opts.requests])
    ]


def _templates(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The few-shot templates whose prompts all fit the engines' context and share several blocks,
    one per distinct set of exemplars (some groups share theirs)."""
    ok = {g: rs for g, rs in by.items() if g != SYSTEM_GROUP and max(len(r["prompt"]) for r in rs) <= FEWSHOT_MAX_CHARS}
    starts = {rs[0]["prompt"][: rs[0]["prefix_chars"]]: g for g, rs in sorted(ok.items(), reverse=True)}
    return sorted(g for g in starts.values() if min(r["prefix_chars"] for r in by[g]) >= FEWSHOT_MIN_SHARED)


def describe(items: list[tuple[str, Messages]]) -> dict[str, Any]:
    groups = Counter(g for g, _ in items)
    chars = [sum(len(m["content"]) for m in msgs) for _, msgs in items]
    names = ", ".join(g.split("/")[-1] for g in sorted(groups))
    note = f"{len(groups)} prefix group(s) ({names})" if len(groups) < len(items) else "no two share a prefix"
    return {"n": len(items), "groups": dict(groups), "prompt_chars": sum(chars), "max_chars": max(chars), "note": note}


async def _main(
    loads: dict[str, list[tuple[str, Messages]]], opts: Options, tmp: Path, console: Console, result: dict[str, Any]
) -> None:
    runs: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        with Fleet(tmp) as fleet:
            redis = await _redis(fleet, tmp)
            t0 = time.monotonic()
            n_ctx = min(MAX_MODEL_LEN, opts.cache_tokens - opts.block_tokens)  # vLLM: a context and a block
            servers = await start_vllm_pool(fleet, http, n_ctx, tmp, opts.block_tokens, opts.cache_tokens)
            result["engines_start_s"] = round(time.monotonic() - t0, 1)
            result["engines_seen"] = [await _engine_seen(http, s) for s in servers]
            console.print(f"two vLLM engines ready in {result['engines_start_s']} s: {result['engines_seen']}")
            bench = Bench(http, servers, redis, f"redis://{HOST}:{redis.port}/0", opts)
            for k, name in enumerate(opts.workloads):
                runs[name] = {}
                order = opts.modes[k % len(opts.modes) :] + opts.modes[: k % len(opts.modes)]  # spread drift
                for mode in order:
                    (work := tmp / f"{name}-{mode}").mkdir()
                    row = runs[name][mode] = await _mode(bench, name, mode, loads[name], work)
                    console.print(f"  {name} / {mode}: {row['rps']:.2f} req/s, TTFT p50 {row['ttft_p50_s']:.2f} s, "
                                  f"hit rate {_f(row['hit_rate'], '.1%')}, requests {row['requests']}")  # fmt: skip
                runs[name] = {m: runs[name][m] for m in opts.modes}
    result["runs"] = runs


async def _redis(fleet: Fleet, tmp: Path) -> Proc:
    """A ``redis-server`` on a free loopback port, stopped with the fleet."""
    proc = await start_redis(fleet, tmp)
    if proc is None:
        raise StartFailed("redis-server is not installed (apt-get install redis-server)")
    return proc


async def _engine_seen(http: aiohttp.ClientSession, server: Proc) -> dict[str, Any]:
    """What the gateway's parser (``backends/engine_load.py``) reads from the engine's real /metrics."""
    async with http.get(server.base + "/metrics") as r:
        body, ctype = await r.read(), r.headers.get("content-type", "")
    return asdict(parse_engine_load("vllm", ctype, body))


async def _counters(http: aiohttp.ClientSession, servers: list[Proc]) -> list[Counts]:
    out = []
    for s in servers:
        async with http.get(s.base + "/metrics") as r:
            out.append(vllm_engine.counters(await r.text(), COUNTERS))
    return out


def policy(bases: list[str], mode: str, redis_url: str, key_prefix: str, opts: Options) -> str:
    replicas = "\n".join(f'      - {{api_base: "{b}"}}' for b in bases)
    dispatch = f"dispatch: {{engine: vllm, interval_s: {opts.interval_s}, block_tokens: {opts.block_tokens}}}"
    rule = {
        "round_robin": "strategy: round_robin",
        "least_load": f"strategy: least_load\n    {dispatch}",
        "admission": f"strategy: round_robin\n    admission: {{{opts.admission}}}",
        "prefix": f"strategy: prefix\n    {dispatch}",
    }[mode]
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}
    {rule}
    health: {{enabled: false}}
    retries: {{attempts: 1}}
    timeouts: {{total_s: 600, first_byte_s: 600}}
models: {{{MODEL}: {{backend: pool}}}}
state: {{store: redis, url: "{redis_url}", prefix: "{key_prefix}"}}
limits: {{max_concurrency: 256}}
logging: {{level: warning, format: json}}
"""


@dataclass(frozen=True)
class Bench:
    """What every mode of the run shares: the engines, Redis, the options."""

    http: aiohttp.ClientSession
    servers: list[Proc]
    redis: Proc
    redis_url: str
    opts: Options


async def _mode(b: Bench, name: str, mode: str, items: list[tuple[str, Messages]], work: Path) -> dict[str, Any]:
    """One workload under one mode: caches emptied, two gateways started, the workload sent."""
    key_prefix = f"fr-{name}-{mode}"

    def text(bases: list[str]) -> str:
        return policy(bases, mode, b.redis_url, key_prefix, b.opts)

    await reset_caches(b.http, b.servers)
    with Fleet(work) as fleet:
        dirs = [work / "gw0", work / "gw1"]
        for d in dirs:
            d.mkdir()
        gws = await asyncio.gather(*(start_gateway(fleet, b.http, d, text, b.servers) for d in dirs))
        await asyncio.sleep(2 * b.opts.interval_s)  # the pollers' first reads
        before = await _counters(b.http, b.servers)
        others = meters.foreign({f"p{i}": p for i, p in enumerate([*fleet.procs, *b.servers, b.redis])})
        wall, done = await _send([g.base + "/v1" for g in gws], [m for _, m in items], b.opts)
        other = others()
        after = await _counters(b.http, b.servers)
        logs = [(d / "triage.log").read_text(errors="replace") for d in dirs]
    placement = await _placement(b.redis_url, key_prefix) if mode == "prefix" else None
    row = _row(wall, done, before, after)
    row.update(
        other_cpu_cores=other,
        log_events={e: n for e in LOG_EVENTS if (n := sum(t.count(e) for t in logs))},
        log_samples=[ln[:400] for t in logs for ln in t.splitlines() if any(e in ln for e in LOG_EVENTS)][:6],
        placement=placement,
    )
    return row


async def _send(bases: list[str], prompts: list[Messages], opts: Options) -> tuple[float, list[dict[str, float]]]:
    """Every request, streamed, through the gateways in turn, ``concurrency`` in flight."""
    gate = asyncio.Semaphore(opts.concurrency)
    hcs = [openai.DefaultAsyncHttpxClient(trust_env=False, timeout=600) for _ in bases]
    clients = [
        openai.AsyncOpenAI(base_url=b, api_key="none", max_retries=0, http_client=h)
        for b, h in zip(bases, hcs, strict=True)
    ]

    async def one(i: int, messages: Messages) -> dict[str, float]:
        async with gate:
            t = time.perf_counter()
            stream = await clients[i % len(clients)].chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=opts.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            ttft, usage = None, None
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - t
                usage = chunk.usage or usage
            end = time.perf_counter() - t
            return {
                "ttft_s": end if ttft is None else ttft,
                "latency_s": end,
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "completion_tokens": usage.completion_tokens if usage else 0,
            }

    try:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    finally:
        for h in hcs:
            await h.aclose()
    return wall, list(done)


def _spread(name: str, xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {f"{name}_p50_s": statistics.median(s), f"{name}_p99_s": s[min(len(s) - 1, int(0.99 * len(s)))]}


def _row(wall: float, done: list[dict[str, float]], before: list[Counts], after: list[Counts]) -> dict[str, Any]:
    d = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    queries = sum(x["vllm:prefix_cache_queries_total"] for x in d)
    hits = sum(x["vllm:prefix_cache_hits_total"] for x in d)
    prompt = sum(r["prompt_tokens"] for r in done)
    completion = sum(r["completion_tokens"] for r in done)
    ttft = [r["ttft_s"] for r in done]
    return {
        "wall_s": wall,
        "rps": len(done) / wall,
        "tok_s": (prompt + completion) / wall,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        **_spread("ttft", ttft),
        **_spread("latency", [r["latency_s"] for r in done]),
        "hit_rate": hits / queries if queries else None,
        "hit_rate_per_engine": [
            x["vllm:prefix_cache_hits_total"] / q if (q := x["vllm:prefix_cache_queries_total"]) else None for x in d
        ],
        "evaluated_tokens": sum(x["vllm:prompt_tokens_total"] for x in d) - hits,
        "requests": [int(x["vllm:request_success_total"]) for x in d],
        "preemptions": [int(x["vllm:num_preemptions_total"]) for x in d],
        "ttft_s": [round(x, 4) for x in ttft],
    }


async def _placement(redis_url: str, key_prefix: str) -> dict[str, Any]:
    """Under ``prefix``: each gateway's picks as it told the other (the shared feed), by prompt start
    (first block): the share of requests on their start's main replica, the starts sent to both
    replicas, and, of the starts both gateways sent, the share whose main replica they agree on."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries: list[Any] = await client.xrange(f"{key_prefix}:feed:dispatch:pool")  # type: ignore[assignment]
    finally:
        await client.aclose()
    picks: dict[int, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))  # start, gateway, replica
    for _, fields in entries:
        item = orjson.loads(fields[b"i"])
        for base, hashes in item["s"]:  # a pick is told only for a prompt of at least one block
            picks[hashes[0]][item["g"]][base] += 1
    on_main = total = split = 0
    agree: list[bool] = []
    for per in picks.values():
        whole: Counter[str] = sum(per.values(), Counter())
        on_main, total, split = on_main + whole.most_common(1)[0][1], total + whole.total(), split + (len(whole) > 1)
        if len(per) > 1:
            agree.append(len({c.most_common(1)[0][0] for c in per.values()}) == 1)
    return {
        "feed_entries": len(entries),
        "gateways_in_feed": len({g for per in picks.values() for g in per}),
        "starts": len(picks),
        "on_main_replica": on_main / total if total else None,
        "starts_on_both_replicas": split,
        "starts_sent_by_both_gateways": len(agree),
        "gateways_agree": sum(agree) / len(agree) if agree else None,
    }


# -- the report ------------------------------------------------------------------------------
def _ratios(runs: dict[str, dict[str, Any]]) -> None:
    for rows in runs.values():
        base = rows["round_robin"]
        for r in rows.values():
            r["rps_x_rr"] = r["rps"] / base["rps"]
            r["ttft_p50_x_rr"] = r["ttft_p50_s"] / base["ttft_p50_s"]
            r["ttft_p99_x_rr"] = r["ttft_p99_s"] / base["ttft_p99_s"]
            r["evaluated_x_rr"] = r["evaluated_tokens"] / base["evaluated_tokens"] if base["evaluated_tokens"] else None


def goals(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for w, rows in runs.items():
        if (p := rows.get("prefix")) is None:
            continue
        if w in PREFIX_HEAVY:
            x, y = p["rps_x_rr"], p["ttft_p50_x_rr"]
            out.append(_goal(f"{w}: prefix req/s >= {RPS_MIN}x round robin", x, x >= RPS_MIN))
            out.append(_goal(f"{w}: prefix TTFT p50 <= {TTFT_MAX}x round robin", y, y <= TTFT_MAX))
        elif "least_load" in rows:
            x = p["rps"] / rows["least_load"]["rps"]
            out.append(
                _goal(f"{w}: prefix req/s within {LEAST_LOAD_TOL:.0%} of least load", x, x >= 1 - LEAST_LOAD_TOL)
            )
            y = p["ttft_p50_s"] / rows["least_load"]["ttft_p50_s"]
            out.append(_goal(f"(info) {w}: prefix TTFT p50 against least load", y, None))
    return out


def _goal(goal: str, value: float, ok: bool | None) -> dict[str, Any]:
    return {"goal": goal, "value": value, "unit": "x", "pass": ok}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


_COLUMNS = [
    "workload", "mode", "wall s", "req/s", "x rr", "tok/s", "TTFT p50 / p99 s", "x rr p50", "latency p50 / p99 s",
    "engine hit rate", "evaluated x rr", "requests A / B", "preempt", "other cores",
]  # fmt: skip


def _cells(w: str, mode: str, r: dict[str, Any]) -> list[str]:
    return [
        *(w, mode, f"{r['wall_s']:.1f}", f"{r['rps']:.2f}", f"{r['rps_x_rr']:.2f}", f"{r['tok_s']:,.0f}"),
        *(f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}", f"{r['ttft_p50_x_rr']:.2f}"),
        *(f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f}", _f(r["hit_rate"], ".1%")),
        *(_f(r["evaluated_x_rr"], ".2f"), " / ".join(map(str, r["requests"]))),
        *(" / ".join(map(str, r["preemptions"])), f"{r['other_cpu_cores']:.2f}"),
    ]


def _table(res: dict[str, Any]) -> Table:
    s = res["settings"]
    t = Table(
        title=f"Two vLLM replicas (CPU, one core each, {s['cache_tokens']:,}-token KV caches in blocks of "
        f"{s['block_tokens']}) behind two triage gateways, streamed chat, max_tokens {s['max_tokens']}, "
        f"concurrency {s['concurrency']}",
        title_justify="left",
    )
    for col in _COLUMNS:
        t.add_column(col, justify="left" if col in ("workload", "mode") else "right")
    for w, rows in res["runs"].items():
        for mode, r in rows.items():
            t.add_row(*_cells(w, mode, r))
        t.add_section()
    return t


def render(console: Console, res: dict[str, Any]) -> None:
    m = res["machine"]
    console.print()
    console.print(
        f"[bold]python -m benchmarks fleet-real[/]  {m['date']}  {m['cpu']}  load average before the run "
        f"{m['load_avg'][0]}; engines ready in {res['engines_start_s']} s"
    )
    console.print(
        "[yellow]note:[/] requests A / B and the hit rate are the engines' own counters "
        "(vllm:request_success, vllm:prefix_cache_hits / queries); 'evaluated' = prompt tokens less hits; "
        "'other cores': CPU used outside the benchmark's processes while the mode ran."
    )
    console.print(_table(res))
    for w, rows in res["runs"].items():
        p = rows.get("prefix", {}).get("placement")
        if p:
            console.print(
                f"{w} / prefix, the shared feed: {p['feed_entries']} entries from {p['gateways_in_feed']} gateways; "
                f"{p['starts']} prompt starts, {_f(p['on_main_replica'], '.0%')} of requests on their start's main "
                f"replica, {p['starts_on_both_replicas']} starts on both; the gateways agree on "
                f"{_f(p['gateways_agree'], '.0%')} of the {p['starts_sent_by_both_gateways']} starts both sent"
            )
        for mode, r in rows.items():
            if r["log_events"]:
                console.print(f"[red]{w} / {mode}: the gateways logged {r['log_events']}[/]")
    console.print(report.goals_table(res["goals"], title="The issue's goals"))
