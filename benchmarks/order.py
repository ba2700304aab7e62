"""``python -m benchmarks order``: does BatchLLM's decode-first order help here? One batch through the Batch
API, planned with ``batches.order: decode_ratio`` and with ``none``, in one run.

Two real llama.cpp servers (``python -m llama_cpp.server``, SmolLM2-135M, one slot each, one thread)
are the replicas of one ``openai`` backend with ``admission: {slots: 1}`` behind a real triage
gateway. The batch is BIG-Bench-Hard few-shot prompts (a few templates, shuffled with a fixed
seed) as ``/v1/completions`` requests at temperature 0 whose ``max_tokens`` is drawn per request
from ``--decode`` (seeded): requests with very different decode work, the case BatchLLM's rule is
for. ``decode_ratio`` sends, at every branch of the prefix tree, the requests with more decode per
prompt token first; ``none`` keeps token order. Each order gets fresh servers and a fresh gateway
(cold caches); rounds alternate which goes first. Reported per order: the batch's wall time (created
to completed), requests/s, completion tokens (from the output file), prompt tokens the servers
evaluated (their logs), and the ratio decode_ratio / none.

With ``engine="vllm"`` the replicas are two vLLM engines (multi-slot: BatchLLM's setting), started
once, their prefix caches emptied before each order; ``slots`` requests each at once, evaluated
tokens from their own counters.
"""

from __future__ import annotations

import asyncio
import io
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks import meters, report
from benchmarks import prefix_bench as prefix
from benchmarks.affinity import MODEL, reset_caches, start_gateway, start_pool, vllm_evaluated, vllm_pool
from benchmarks.overhead import machine
from benchmarks.procs import Fleet, Proc

ORDERS = ("decode_ratio", "none")


@dataclass(frozen=True)
class Options:
    data: Path = prefix.DATA
    limit: int = 40
    templates: int = 4
    seed: int = 0
    decode: tuple[int, ...] = (1, 48)  # max_tokens drawn per request from these
    concurrency: int = 2  # batches.concurrency
    n_threads: int = 1
    rounds: int = 2
    engine: str = "llama"  # or "vllm"
    slots: int = 1  # admission slots per replica: llama.cpp's server has one; vLLM runs many at once
    vllm_block_size: int = 32
    vllm_cache_tokens: int = 0
    out: Path = Path("out/bench-order.json")


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its table and write its JSON report; returns the report."""
    opts = Options(**kwargs)
    if min(opts.concurrency, opts.rounds, opts.limit, *opts.decode) < 1:
        raise ValueError("concurrency, rounds, limit and every decode length must be at least 1")
    if opts.engine not in ("llama", "vllm"):
        raise ValueError("engine is llama or vllm")
    console = Console()
    popts = prefix.Options(data=opts.data, limit=opts.limit, templates=opts.templates, seed=opts.seed, repeats=1)
    rows = prefix.load(popts)
    rng = random.Random(opts.seed)
    lines = [
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": MODEL,
                    "prompt": r["prompt"],
                    "max_tokens": rng.choice(opts.decode),
                    "temperature": 0.0,
                },
            }
        )
        for i, r in enumerate(rows)
    ]
    tokens = prefix.scheduler(rows, popts)["tokens"]
    n_ctx = -(-(max(map(len, tokens)) + max(opts.decode) + 16) // 256) * 256
    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {**asdict(opts), "data": str(opts.data), "out": str(opts.out)},
        "batch": {
            "n": len(rows),
            "templates": len({r["group"] for r in rows}),
            "n_ctx": n_ctx,
            "prompt_tokens": sum(map(len, tokens)),
            "max_tokens_asked": sum(orjson.loads(x)["body"]["max_tokens"] for x in lines),
        },
    }
    console.print(
        f"[bold]batch[/]: {len(rows)} prompts, {result['batch']['templates']} templates, max_tokens from "
        f"{opts.decode}, {result['batch']['prompt_tokens']:,} prompt tokens"
    )
    with tempfile.TemporaryDirectory(prefix="triage-bench-order-") as tmp:
        result["rounds"] = asyncio.run(_main(b"\n".join(lines), n_ctx, opts, Path(tmp), console))
    result["summary"] = summary(result["rounds"])
    render(console, result)
    report.save(console, opts.out, result)
    return result


async def _main(batch: bytes, n_ctx: int, opts: Options, tmp: Path, console: Console) -> list[dict[str, Any]]:
    rounds: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
        vllm_pool(http, n_ctx, tmp, opts.engine, opts.vllm_block_size, opts.vllm_cache_tokens) as pool,
    ):
        for k in range(opts.rounds):
            rounds.append({})
            for order in ORDERS if k % 2 == 0 else ORDERS[::-1]:
                work = tmp / f"{k}-{order}"
                work.mkdir()
                row = await _order(http, batch, order, n_ctx, opts, work, pool)
                rounds[-1][order] = row
                console.print(
                    f"  round {k + 1}, {order}: {row['wall_s']:.1f} s, {row['completion_tokens']} "
                    f"completion tokens, evaluated {row['evaluated_per_server']}"
                )
    return [{o: r[o] for o in ORDERS} for r in rounds]


def policy(bases: list[str], work: Path, order: str, concurrency: int, slots: int = 1) -> str:
    replicas = "\n".join(f'      - {{api_base: "{b}"}}' for b in bases)
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}
    admission: {{slots: {slots}}}
    health: {{enabled: false}}
    retries: {{attempts: 1}}
    timeouts: {{total_s: 600}}
models:
  {MODEL}: {{backend: pool}}
batches: {{dir: "{work / "batches"}", concurrency: {concurrency}, order: {order}, tokens: approx}}
limits: {{max_concurrency: 256}}
logging: {{level: warning, format: json}}
"""


async def _order(
    http: aiohttp.ClientSession,
    batch: bytes,
    order: str,
    n_ctx: int,
    opts: Options,
    work: Path,
    pool: list[Proc] | None = None,
) -> dict[str, Any]:
    def text(bases: list[str]) -> str:
        return policy(bases, work, order, opts.concurrency, opts.slots)

    with Fleet(work) as fleet:
        if pool is None:
            servers, gw = await start_pool(fleet, http, n_ctx, opts.n_threads, work, text)
        else:
            servers = pool
            await reset_caches(http, servers)
            gw = await start_gateway(fleet, http, work, text, servers)
        starts = [s.log_path.stat().st_size for s in servers]
        before = [await vllm_evaluated(http, s) for s in servers] if pool else []
        others = meters.foreign({p.name: p for p in [*fleet.procs, *(pool or [])]})
        wall, out = await _submit(gw.base + "/v1", batch)
        other_cores = others()
        done = [o for o in out if o.get("response") and o["response"]["status_code"] == 200]
        if pool:
            after = [await vllm_evaluated(http, s) for s in servers]
            evaluated = [int(a - b) for a, b in zip(after, before, strict=True)]
            per_server = [None] * len(servers)  # vLLM's counters do not say; the gateway's would
        else:
            logged = [
                prefix._PROMPT_EVAL.findall(s.log_path.read_bytes()[st:].decode("utf-8", "replace"))
                for s, st in zip(servers, starts, strict=True)
            ]
            evaluated = [sum(map(int, found)) for found in logged]
            per_server = [len(found) for found in logged]
    return {
        "order": order,
        "wall_s": wall,
        "rps": len(done) / wall,
        "completed": len(done),
        "failed": len(out) - len(done),
        "completion_tokens": sum(o["response"]["body"]["usage"]["completion_tokens"] for o in done),
        "evaluated_per_server": evaluated,
        "evaluated_tokens": sum(evaluated),
        "requests_per_server": per_server,
        "other_cpu_cores": other_cores,
    }


async def _submit(base_url: str, batch: bytes) -> tuple[float, list[dict[str, Any]]]:
    """The batch through the official client: wall time from create to completed, and its output."""
    async with httpx.AsyncClient(trust_env=False, timeout=600) as hc:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=hc)
        f = await client.files.create(file=("batch.jsonl", io.BytesIO(batch)), purpose="batch")
        t0 = time.perf_counter()
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while b.status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.2)
            b = await client.batches.retrieve(b.id)
        wall = time.perf_counter() - t0
        if b.status != "completed" or b.output_file_id is None:
            raise RuntimeError(f"the batch ended {b.status}: {b.errors}")
        text = (await client.files.content(b.output_file_id)).text
    return wall, [orjson.loads(x) for x in text.splitlines() if x.strip()]


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for order in ORDERS:
        rows = [r[order] for r in rounds]
        out[order] = {
            "wall_s": sum(r["wall_s"] for r in rows),
            "rps": sum(r["completed"] for r in rows) / sum(r["wall_s"] for r in rows),
            "evaluated_tokens": sum(r["evaluated_tokens"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "per_round_wall_s": [r["wall_s"] for r in rows],
        }
    base = out["none"]
    for row in out.values():
        row["rps_x_none"] = row["rps"] / base["rps"]
    d = out["decode_ratio"]["rps_x_none"]
    per_round = [r["none"]["wall_s"] / r["decode_ratio"]["wall_s"] for r in rounds]
    out["verdict"] = (
        f"decode_ratio gives {d:.2f}x the requests/s of token order (per round "
        f"{', '.join(f'{x:.2f}x' for x in per_round)}): "
        + ("it helps here." if d > 1.05 and min(per_round) > 1.0 else "no gain beyond noise here.")
    )
    return out


def render(console: Console, res: dict[str, Any]) -> None:
    m, b, s = res["machine"], res["batch"], res["settings"]
    console.print()
    console.print(
        f"[bold]python -m benchmarks order[/]  {m['date']}  {m['platform']}  {m['nproc']} CPUs; {b['n']} prompts, "
        f"{b['templates']} templates, max_tokens from {tuple(s['decode'])} "
        f"({b['max_tokens_asked']:,} all told), "
        f"batches.concurrency {s['concurrency']}, two "
        + ("vLLM replicas" if s["engine"] == "vllm" else "one-slot llama.cpp replicas")
        + f" with admission ({s['slots']} slot(s) each)"
    )
    t = Table(title="The same batch, planned decode-first and in token order", title_justify="left")
    for col in (
        "round",
        "order",
        "wall s",
        "req/s",
        "completion tok",
        "evaluated A / B",
        "requests A / B",
        "other cores",
    ):
        t.add_column(col, justify="left" if col in ("round", "order") else "right")
    for k, rnd in enumerate(res["rounds"]):
        for order, r in rnd.items():
            t.add_row(
                str(k + 1),
                order,
                f"{r['wall_s']:.1f}",
                f"{r['rps']:.3f}",
                f"{r['completion_tokens']:,}",
                " / ".join(f"{x:,}" for x in r["evaluated_per_server"]),
                " / ".join("-" if x is None else str(x) for x in r["requests_per_server"]),
                f"{r['other_cpu_cores']:.2f}",
            )
    for order in ORDERS:
        r = res["summary"][order]
        t.add_row(
            "all",
            order,
            f"{r['wall_s']:.1f}",
            f"{r['rps']:.3f} ({r['rps_x_none']:.2f}x)",
            f"{r['completion_tokens']:,}",
            f"{r['evaluated_tokens']:,}",
            "",
            "",
        )
    console.print(t)
    console.print(
        f"[bold]verdict:[/] {res['summary']['verdict']} (median round wall: "
        f"{statistics.median(res['summary']['decode_ratio']['per_round_wall_s']):.1f} s decode_ratio, "
        f"{statistics.median(res['summary']['none']['per_round_wall_s']):.1f} s none)"
    )
