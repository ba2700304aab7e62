"""What an engine says of its own load: requests running and waiting, KV-cache usage, its cache's
size and its prefix cache's counters, read from its metrics endpoint.

- vLLM: ``GET /metrics`` (Prometheus text): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (``gpu_cache_usage_perc`` before
  0.10), ``vllm:prefix_cache_queries``/``hits`` and ``vllm:cache_config_info`` (its labels give
  ``block_size`` and ``num_gpu_blocks``: the cache's capacity).
- llama.cpp's server (``--metrics``): ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``, ``llamacpp:kv_cache_usage_ratio``.
- SGLang: ``GET /get_load`` (JSON, one entry per data-parallel rank: ``num_reqs``,
  ``num_waiting_reqs``), or its ``/metrics`` (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage``).

A text that names none of an engine's load figures is malformed: :class:`Malformed`, and the
caller counts the replica as unknown (never as idle). Parsing only; the polling is in
``backends/engine_poll.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from prometheus_client.parser import text_string_to_metric_families

EngineKind = Literal["vllm", "llamacpp", "sglang"]
METRICS_PATH: dict[str, str] = {"vllm": "/metrics", "llamacpp": "/metrics", "sglang": "/get_load"}


class Malformed(ValueError):
    """An engine's metrics answer that gives no load."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float | None = None  # 0..1
    block_size: int | None = None  # tokens per KV block (vLLM's cache_config_info)
    blocks: int | None = None  # blocks the cache holds
    prefix_queries: float | None = None  # tokens asked of the prefix cache, since the engine started
    prefix_hits: float | None = None  # of which found

    @property
    def queue(self) -> float:
        return self.running + self.waiting


# (running, waiting, kv usage) metric names per engine, newest first where they were renamed
_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:num_requests_running",),
        ("vllm:num_requests_waiting",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "llamacpp": (
        ("llamacpp:requests_processing",),
        ("llamacpp:requests_deferred",),
        ("llamacpp:kv_cache_usage_ratio",),
    ),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
}


def parse(kind: EngineKind, content_type: str, body: bytes) -> EngineLoad:
    """An engine's metrics answer as an :class:`EngineLoad`; :class:`Malformed` when it gives none."""
    if kind == "sglang" and not content_type.startswith("text/plain"):
        return _sglang_load(body)
    try:
        text = body.decode("utf-8")
        sums: dict[str, float] = {}
        info: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isfinite(s.value):
                    continue
                sums[s.name] = sums.get(s.name, 0.0) + s.value  # summed over an engine's ranks
                if s.name == "vllm:cache_config_info":
                    info = dict(s.labels)
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise Malformed(f"not Prometheus text: {exc}") from None
    run_names, wait_names, kv_names = _NAMES[kind]
    running = _first(sums, run_names)
    waiting = _first(sums, wait_names)
    if running is None or waiting is None:
        raise Malformed(f"no {run_names[0]} or {wait_names[0]}")
    kv = _first(sums, kv_names)
    return EngineLoad(
        max(0.0, running),
        max(0.0, waiting),
        None if kv is None else min(1.0, max(0.0, kv)),
        _int(info.get("block_size")),
        _int(info.get("num_gpu_blocks")),
        _first(sums, ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")),
        _first(sums, ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")),
    )


def _sglang_load(body: bytes) -> EngineLoad:
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Malformed(f"not JSON: {exc}") from None
    ranks = data if isinstance(data, list) else [data]
    running = waiting = 0.0
    for r in ranks:
        if not isinstance(r, dict) or not isinstance(r.get("num_reqs"), int | float):
            raise Malformed("no num_reqs")
        queued = r.get("num_waiting_reqs", 0)
        waiting += float(queued) if isinstance(queued, int | float) else 0.0
        running += max(0.0, float(r["num_reqs"]) - (float(queued) if isinstance(queued, int | float) else 0.0))
    return EngineLoad(running, waiting)


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((sums[n] for n in names if n in sums), None)


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
