"""``python -m benchmarks affinity``: does online prefix affinity, or the admission window, help? Round robin
against both, in one run.

Two real llama.cpp servers (``python -m llama_cpp.server``, SmolLM2-135M, one slot each that keeps
its previous prompt, one thread each) are the replicas of one ``openai`` backend behind a real
triage gateway (``strategy: round_robin``, health checks off, one attempt). Each mode starts its
own servers and gateway, so both start cold:

- ``round_robin``: ``prefix_affinity_chars: 0``, the baseline;
- ``affinity``: ``prefix_affinity_chars: N`` (``--chars``): a request's replica is chosen by
  rendezvous hashing of its prompt's first N characters;
- ``admission``: ``admission: {slots: 1, ...}`` (``--admission``): requests wait in the gateway
  for a free replica slot, and a freed replica takes the waiting request its cache holds
  (``backends/admission.py``).

With ``engine="vllm"`` (``--engine vllm``; ``make vllm`` builds it) the replicas are two real vLLM
engines (CPU build, SmolLM2-135M, one core each), multi-slot engines with a prefix cache of many
blocks: they start once for the whole run, and each mode empties their caches first
(``POST /reset_prefix_cache``) and runs behind a gateway of its own. Their evaluated tokens are
vLLM's own counters (``vllm:prompt_tokens_total - vllm:prefix_cache_hits_total``); the admission
mode's ``slots`` are then the requests each engine runs at once. The goal of issue 19: admission
>= 1.3x round robin's requests/s at an equal or better p99.

The workload is BIG-Bench-Hard few-shot prompts (a few templates, shuffled with a fixed seed: the
arrival order), sent as ``/v1/completions`` with ``max_tokens=1`` through the gateway with the
official ``openai`` client, in arrival order, ``--concurrency`` in flight. Reported per mode: wall
time, requests/s, latency, requests per replica (the gateway's ``triage_upstream_attempts``),
prompt tokens each server evaluated (llama.cpp's own count from its verbose log, as in
``python -m benchmarks prefix``), reuse achieved against the ideal (:func:`backends.prefix.ideal_reuse` on
SmolLM2's own tokens), the reuse a one-slot cache per replica would reach with the mode's
assignment, and the ratios affinity / round robin. Rendezvous hashing depends on the replicas'
addresses (free ports, so each run differs): the report also gives the odds of each split over
random addresses, for this batch's affinity keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from backends.gguf import smollm2_path
from backends.prefix import ideal_reuse
from benchmarks import meters, report
from benchmarks import prefix_bench as prefix
from benchmarks import vllm as vllm_engine
from benchmarks.affinity_odds import _per_template, assign, predicted_reuse, split_odds
from benchmarks.overhead import machine
from benchmarks.procs import HOST, Fleet, Proc, StartFailed, child_env, free_port

DATA = prefix.DATA
MODES = ("round_robin", "affinity", "admission")
ENGINES = ("llama", "vllm")
VLLM_ADMISSION_RPS_MIN = 1.3  # issue 19: the admission window on two vLLM replicas against round robin
MODEL = "smollm2"
ODDS_DRAWS = 2000  # random replica address pairs for the split odds
# llama.cpp's time for one completion (timings reset when it starts, printed when it ends): a server's busy time
_TOTAL_TIME = re.compile(r"llama_perf_context_print:\s+total time =\s*([\d.]+) ms")


@dataclass(frozen=True)
class Options:
    data: Path = DATA
    limit: int = 48
    templates: int = 4
    seed: int = 0
    concurrency: int = 2
    chars: int = 200
    admission: str = "slots: 1, max_skips: 8, window_ms: 0"  # the admission mode's settings (YAML flow mapping)
    modes: tuple[str, ...] = MODES
    n_threads: int = 1
    rounds: int = 3  # each round starts fresh servers on new ports: a new draw of the affinity split
    engine: str = "llama"  # or "vllm": two vLLM engines, started once, caches emptied before each mode
    vllm_block_size: int = 32
    vllm_cache_tokens: int = 0  # each engine's KV cache in tokens; 0: vLLM's own (1 GiB)
    out: Path = Path("out/bench-affinity.json")


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its table and write its JSON report; returns the report."""
    from benchmarks.affinity_report import (  # the report imports this module's constants
        _ratios,
        render,
        summary,
        verdict,
    )

    opts = Options(**kwargs)
    if min(opts.chars, opts.concurrency, opts.rounds) < 1:
        raise ValueError("chars, concurrency and rounds must be at least 1")
    if "round_robin" not in opts.modes or not set(opts.modes) <= set(MODES):
        raise ValueError(f"modes are some of {', '.join(MODES)}, round_robin (the baseline) among them")
    if opts.engine not in ENGINES:
        raise ValueError(f"engine is one of {', '.join(ENGINES)}")
    console = Console()
    popts = prefix.Options(data=opts.data, limit=opts.limit, templates=opts.templates, seed=opts.seed, repeats=1)
    rows = prefix.load(popts)
    prompts = [r["prompt"] for r in rows]
    tokens = prefix.scheduler(rows, popts)["tokens"]  # SmolLM2's own tokens (GGUF vocab)
    n_ctx = -(-(max(map(len, tokens)) + 16) // 256) * 256
    keys = [p[: opts.chars] for p in prompts]
    groups = [r["group"] for r in rows]
    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {**asdict(opts), "data": str(opts.data), "out": str(opts.out)},
        "batch": {
            "n": len(rows),
            "templates": len({r["group"] for r in rows}),
            "n_ctx": n_ctx,
            "prompt_tokens": sum(map(len, tokens)),
            "max_prompt_tokens": max(map(len, tokens)),
            "affinity_keys": len(set(keys)),
            "ideal_reuse": ideal_reuse(tokens),
            "ideal_tokens": "SmolLM2's own tokens (llama_cpp.Llama vocab_only)",
            "per_template": _per_template(rows, tokens),
        },
        "split_odds": split_odds(keys, tokens, ODDS_DRAWS, opts.seed),
    }
    b = result["batch"]
    console.print(
        f"[bold]batch[/]: {b['n']} prompts from {opts.data.name}, {b['templates']} templates, seed "
        f"{opts.seed}, {b['prompt_tokens']:,} prompt tokens, ideal reuse {b['ideal_reuse']:.1%}; "
        f"{b['affinity_keys']} distinct affinity keys at {opts.chars} characters"
    )
    with tempfile.TemporaryDirectory(prefix="triage-bench-affinity-") as tmp:
        result["rounds"] = asyncio.run(_main(prompts, tokens, keys, groups, n_ctx, opts, Path(tmp), console))
    _ratios(result)
    result["summary"] = summary(result)
    result["verdict"] = verdict(result)
    render(console, result)
    report.save(console, opts.out, result)
    return result


async def _main(
    prompts: list[str],
    tokens: list[tuple[int, ...]],
    keys: list[str],
    groups: list[str],
    n_ctx: int,
    opts: Options,
    tmp: Path,
    console: Console,
) -> list[dict[str, Any]]:
    """``rounds`` rounds of both modes, each from cold servers; the order of the modes alternates."""
    rounds: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
        vllm_pool(http, n_ctx, tmp, opts.engine, opts.vllm_block_size, opts.vllm_cache_tokens) as pool,
    ):
        for k in range(opts.rounds):
            rounds.append({})
            for mode in opts.modes if k % 2 == 0 else opts.modes[::-1]:
                chars = opts.chars if mode == "affinity" else 0
                window = opts.admission if mode == "admission" else None
                console.print(
                    f"[bold]round {k + 1}, {mode}[/] (prefix_affinity_chars: {chars}, admission: "
                    f"{window}): {len(prompts)} requests, concurrency {opts.concurrency}"
                )
                work = tmp / f"{k}-{mode}"
                work.mkdir()
                row = await _mode(http, prompts, tokens, keys, groups, (chars, window), n_ctx, opts, work, pool)
                rounds[-1][mode] = row
                console.print(
                    f"  {row['wall_s']:.1f} s, requests {row['requests']}, evaluated {row['evaluated_per_server']}"
                )
    return [{m: r[m] for m in opts.modes} for r in rounds]


def _server_argv(port: int, n_ctx: int, threads: int) -> list[str]:
    t = str(threads)
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_path()),
        "--model_alias",
        MODEL,
        "--host",
        HOST,
        "--port",
        str(port),
        "--n_threads",
        t,
        "--n_threads_batch",
        t,
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
        "--verbose",
        "True",
    ]


def policy(bases: list[str], chars: int, admission: str | None = None) -> str:
    replicas = "\n".join(f'      - {{api_base: "{b}"}}' for b in bases)
    admission = "" if admission is None else f"\n    admission: {{{admission}}}"
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}
    strategy: round_robin
    prefix_affinity_chars: {chars}{admission}
    health: {{enabled: false}}
    retries: {{attempts: 1}}
    timeouts: {{total_s: 600}}
models:
  {MODEL}:
    backend: pool
limits:
  max_concurrency: 256
logging:
  level: warning
  format: json
"""


async def start_pool(
    fleet: Fleet,
    http: aiohttp.ClientSession,
    n_ctx: int,
    threads: int,
    work: Path,
    policy_text: Callable[[list[str]], str],
) -> tuple[list[Proc], Proc]:
    """Two llama.cpp servers (warmed up: the first request's one-off costs stay out of the
    measurement) and a triage gateway whose policy ``policy_text`` writes for their ``/v1`` bases."""
    servers = []
    for i in range(2):
        port = free_port()
        servers.append(
            fleet.add(
                Proc(f"llama-{i}", _server_argv(port, n_ctx, threads), port, "/v1/models", work / f"llama-{i}.log")
            )
        )
    await asyncio.gather(*(s.wait_ready(http, 180) for s in servers))
    for s in servers:
        await prefix._complete(http, s.base + "/v1/completions", prefix.RESET_PROMPT)
    return servers, await start_gateway(fleet, http, work, policy_text, servers)


async def start_vllm_pool(
    fleet: Fleet, http: aiohttp.ClientSession, n_ctx: int, tmp: Path, block_size: int = 32, cache_tokens: int = 0
) -> list[Proc]:
    """Two vLLM engines, one core each, warmed up; their development routes on (the cache reset)."""
    if (reason := vllm_engine.missing()) is not None:
        raise StartFailed(reason)
    servers = []
    for i in range(2):
        port = free_port()
        argv = vllm_engine.argv(port, max_model_len=n_ctx, extra=vllm_engine.cache_args(block_size, cache_tokens))
        env = vllm_engine.env(child_env(), cpu=i, dev=True)
        servers.append(fleet.add(Proc(f"vllm-{i}", argv, port, vllm_engine.READY_PATH, tmp / f"vllm-{i}.log", env=env)))
    await asyncio.gather(*(s.wait_ready(http, vllm_engine.START_TIMEOUT_S) for s in servers))
    for s in servers:
        await prefix._complete(http, s.base + "/v1/completions", prefix.RESET_PROMPT)
    return servers


@contextlib.asynccontextmanager
async def vllm_pool(
    http: aiohttp.ClientSession, n_ctx: int, tmp: Path, engine: str, block_size: int, cache_tokens: int
) -> AsyncIterator[list[Proc] | None]:
    """Two vLLM engines for the whole run when ``engine`` is vllm, stopped when it ends; else None
    (each mode then starts llama.cpp servers of its own)."""
    if engine != "vllm":
        yield None
        return
    with Fleet(tmp) as fleet:
        yield await start_vllm_pool(fleet, http, n_ctx, tmp, block_size, cache_tokens)


async def reset_caches(http: aiohttp.ClientSession, servers: list[Proc]) -> None:
    """Empty every vLLM engine's prefix cache (a development route: ``env(dev=True)``)."""
    for s in servers:
        async with http.post(s.base + "/reset_prefix_cache") as r:
            if r.status != 200:
                raise RuntimeError(f"{s.name} did not empty its prefix cache: HTTP {r.status}")


async def vllm_evaluated(http: aiohttp.ClientSession, server: Proc) -> float:
    """Prompt tokens the engine computed so far: seen less read from its prefix cache."""
    async with http.get(server.base + "/metrics") as r:
        c = vllm_engine.counters(await r.text(), prefix.VLLM_COUNTERS)
    return c["vllm:prompt_tokens_total"] - c["vllm:prefix_cache_hits_total"]


async def start_gateway(
    fleet: Fleet,
    http: aiohttp.ClientSession,
    work: Path,
    policy_text: Callable[[list[str]], str],
    servers: list[Proc],
) -> Proc:
    """A triage gateway whose policy ``policy_text`` writes for the servers' ``/v1`` bases."""
    (work / "policy.yaml").write_text(policy_text([s.base + "/v1" for s in servers]))
    port = free_port()
    gw = fleet.add(
        Proc(
            "triage",
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--policy",
                str(work / "policy.yaml"),
                "--host",
                HOST,
                "--port",
                str(port),
                "--no-watch",
            ],
            port,
            "/v1/models",
            work / "triage.log",
        )
    )
    await gw.wait_ready(http, 120)
    return gw


async def _mode(
    http: aiohttp.ClientSession,
    prompts: list[str],
    tokens: list[tuple[int, ...]],
    keys: list[str],
    groups: list[str],
    rule: tuple[int, str | None],
    n_ctx: int,
    opts: Options,
    work: Path,
    pool: list[Proc] | None = None,
) -> dict[str, Any]:
    """One mode: llama.cpp servers started for it (``pool`` None), or the running vLLM ``pool``, emptied."""
    chars, window = rule

    def text(bases: list[str]) -> str:
        return policy(bases, chars, window)

    with Fleet(work) as fleet:
        if pool is None:
            servers, gw = await start_pool(fleet, http, n_ctx, opts.n_threads, work, text)
        else:
            servers = pool
            await reset_caches(http, servers)
            gw = await start_gateway(fleet, http, work, text, servers)
        bases = [s.base + "/v1" for s in servers]
        starts = [s.log_path.stat().st_size for s in servers]
        before = [await vllm_evaluated(http, s) for s in servers] if pool else []
        others = meters.foreign({p.name: p for p in [*fleet.procs, *(pool or [])]})
        wall, latencies, counts = await _send(gw.base + "/v1", prompts, opts.concurrency)
        other_cores = others()
        per_replica = await _attempts(http, gw.base)
        requests = [per_replica.get(b, 0) for b in bases]
        if pool:
            after = [await vllm_evaluated(http, s) for s in servers]
            parsed: list[tuple[int | None, int | None]] = [
                (int(a - b), None) for a, b in zip(after, before, strict=True)
            ]
            texts = None
        else:
            parsed = [
                await prefix._parse_log(s.log_path, st, n) for s, st, n in zip(servers, starts, requests, strict=True)
            ]
            texts = [_read_from(s.log_path, st) for s, st in zip(servers, starts, strict=True)]
    # llama.cpp logs each request's work; vLLM's counters give no busy time
    logged = requests if texts is None else [len(prefix._PROMPT_EVAL.findall(t)) for t in texts]
    busy = None if texts is None else [sum(map(float, _TOTAL_TIME.findall(t))) / 1000 for t in texts]
    evaluated = [ev for ev, _ in parsed]
    where = None if window is not None else assign(keys, bases, chars)  # admission's choice is dynamic
    lat = sorted(latencies)
    placed = (
        None
        if where is None
        else {g: sorted({w for w, gg in zip(where, groups, strict=True) if gg == g}) for g in sorted(set(groups))}
    )
    total_ev = None if None in evaluated else sum(e for e in evaluated if e is not None)
    return {
        "prefix_affinity_chars": chars,
        "admission": window,
        "replicas": bases,
        "wall_s": wall,
        "rps": len(prompts) / wall,
        "latency_p50_s": statistics.median(lat),
        "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "prompt_tokens": sum(counts),
        "requests": requests,
        "requests_in_logs": logged,
        "evaluated_per_server": evaluated,
        "evaluated_tokens": total_ev,
        "busy_s_per_server": busy,
        "utilization": None if busy is None else sum(busy) / (len(servers) * wall),
        "prefix_hits_per_server": [hits for _, hits in parsed],
        "predicted_requests": None if where is None else [where.count(r) for r in range(2)],
        "predicted_reuse": None if where is None else predicted_reuse(tokens, where, 2),
        "other_cpu_cores": other_cores,
        "template_replicas": placed,
        "latencies_s": [round(x, 4) for x in latencies],
    }


async def _send(base_url: str, prompts: list[str], concurrency: int) -> tuple[float, list[float], list[int]]:
    """Every prompt through the gateway, in arrival order, ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=600) as hc:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=hc)

        async def one(p: str) -> tuple[float, int]:
            async with gate:
                t = time.perf_counter()
                r = await client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0.0)
                return time.perf_counter() - t, r.usage.prompt_tokens if r.usage else 0

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return wall, [d[0] for d in done], [d[1] for d in done]


async def _attempts(http: aiohttp.ClientSession, base: str) -> dict[str, int]:
    """Tries per replica, from the gateway's own ``triage_upstream_attempts`` counter."""
    async with http.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "triage_upstream_attempts":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["replica"]] = out.get(s.labels["replica"], 0) + int(s.value)
    return out


def _read_from(path: Path, start: int) -> str:
    with path.open("rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", "replace")
