"""The fleet simulator's workloads, from the shared data (``../shared/data``), deterministic for a seed.

- ``multi_turn``: MT-Bench's two-turn questions, one conversation each (a session line first, so
  conversations share nothing); turn 2's prompt is turn 1's, a simulated answer (filler text of
  real words, fixed per conversation: the turn's output) and turn 2; it arrives ``think`` seconds
  after turn 1 ends. The conversation's id is the request's ``affinity``.
- ``fewshot``: BIG-Bench-Hard 3-shot CoT prompts (27 templates shared by their task's questions).
- ``system_prompt``: one long system prompt (BBH CoT templates' text, about 3,000 tokens) and
  many users' questions (Arena-Hard's prompts).
- ``unique``: Arena-Hard's prompts, each behind its own request id: no shared prefix at all.

A workload is a list of requests with arrival times for a rate of one request a second (scaled
by the caller); :func:`instances` makes fresh ones for each run.
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.fleet_sim import Request
from policies.dispatch import block_hashes

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WORKLOADS: tuple[str, ...] = ("multi_turn", "fewshot", "system_prompt", "unique")
MAX_BYTES = 24_000  # a prompt's text is cut here (Arena-Hard has a few very long ones)


@dataclass
class Spec:
    text: str
    output: int
    affinity: str | None = None
    answer: str = ""  # cached with the prompt when it ends (a conversation's answer)
    then: Spec | None = None
    think: float = 0.0


@dataclass
class Workload:
    name: str
    specs: list[Spec]  # first requests, in arrival order
    gaps: list[float]  # arrival gaps at one request a second
    hashes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(2 if s.then is not None else 1 for s in self.specs)

    def instances(self, block_tokens: int, rate: float) -> tuple[list[tuple[float, Request]], list[Request]]:
        """Fresh requests: (arrival time at ``rate`` requests a second, first request) and every
        request in arrival order of the first ones (for the oracle)."""
        bb = block_tokens * 4
        rid = 0
        timed: list[tuple[float, Request]] = []
        flat: list[Request] = []
        t = 0.0
        for spec, gap in zip(self.specs, self.gaps, strict=True):
            t += gap / rate
            chain: list[Request] = []
            s: Spec | None = spec
            while s is not None:
                rid += 1
                chain.append(self._request(rid, s, bb))
                s = s.then
            for a, b in itertools.pairwise(chain):
                a.then = b
            timed.append((t, chain[0]))
            flat.extend(chain)
        return timed, flat

    def _request(self, rid: int, s: Spec, bb: int) -> Request:
        hashes = self._hashes(s.text, bb)
        extra: tuple[int, ...] = ()
        if s.answer:
            extra = self._hashes(s.text + s.answer, bb)[len(hashes) :]
        prompt = math.ceil(len(s.text.encode()) / 4)
        return Request(rid, s.text, prompt, s.output, hashes, extra, s.affinity, think=s.think, answer=s.answer)

    def _hashes(self, text: str, bb: int) -> tuple[int, ...]:
        key = f"{bb}:{text}"
        got = self.hashes.get(key)
        if got is None:
            got = self.hashes[key] = block_hashes(text, bb, limit=1 << 20)
        return got


def _jsonl(path: Path) -> list[dict[str, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _gaps(rng: random.Random, n: int) -> list[float]:
    return [rng.expovariate(1.0) for _ in range(n)]


def _filler(rng: random.Random, words: list[str], tokens: int) -> str:
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(words)
        out.append(w)
        size += len(w.encode()) + 1
    return " ".join(out)


def multi_turn(n: int, seed: int, data: Path = DATA, answer_tokens: int = 256) -> Workload:
    rows = _jsonl(data / "open" / "mt_bench.jsonl")
    words = " ".join(str(r["prompt"]) for r in _jsonl(data / "open" / "arena_hard_v0.1.jsonl")).split()
    rng = random.Random(seed)
    specs = []
    for c in range((n + 1) // 2):
        r = rows[c % len(rows)]
        turns = list(r["turns"])  # type: ignore[call-overload]
        t1 = f"Session {seed}-{c:06d}.\nUser: {turns[0]}"
        answer = "\nAssistant: " + _filler(random.Random(f"{seed}-{c}"), words, answer_tokens)
        t2 = Spec(f"{t1}{answer}\nUser: {turns[1]}", rng.randint(64, 320), affinity=f"s{c}")
        specs.append(Spec(t1, answer_tokens, f"s{c}", answer, t2, think=rng.uniform(2.0, 10.0)))
    return Workload("multi_turn", specs, _gaps(rng, len(specs)))


def fewshot(n: int, seed: int, data: Path = DATA) -> Workload:
    rows = _jsonl(data / "prefix" / "bbh_fewshot_cot.jsonl.gz")
    rng = random.Random(seed)
    rng.shuffle(rows)
    specs = [Spec(str(r["prompt"])[:MAX_BYTES], rng.randint(32, 192)) for r in rows[:n]]
    return Workload("fewshot", specs, _gaps(rng, len(specs)))


def _questions(data: Path, seed: int) -> list[str]:
    rows = _jsonl(data / "open" / "arena_hard_v0.1.jsonl")
    rng = random.Random(seed)
    qs = [str(r["prompt"])[:MAX_BYTES] for r in rows]
    rng.shuffle(qs)
    return qs


def system_prompt(n: int, seed: int, data: Path = DATA, system_tokens: int = 3000) -> Workload:
    tpl = _jsonl(data / "prefix" / "bbh_fewshot_cot.jsonl.gz")
    seen: dict[str, str] = {}
    for r in tpl:
        seen.setdefault(str(r["group"]), str(r["prompt"])[: int(r["prefix_chars"])])  # type: ignore[call-overload]
    system = "System: " + "\n\n".join(seen.values())
    system = system.encode()[: system_tokens * 4].decode("utf-8", "ignore") + "\n"
    qs = _questions(data, seed)
    rng = random.Random(seed)
    specs = [Spec(f"{system}User {k}: {qs[k % len(qs)]}", rng.randint(32, 256)) for k in range(n)]
    return Workload("system_prompt", specs, _gaps(rng, len(specs)))


def unique(n: int, seed: int, data: Path = DATA) -> Workload:
    qs = _questions(data, seed)
    rng = random.Random(seed)
    specs = [Spec(f"[request {seed}-{k:07d}] {qs[k % len(qs)]}", rng.randint(32, 256)) for k in range(n)]
    return Workload("unique", specs, _gaps(rng, len(specs)))


def load(name: str, n: int, seed: int = 0, data: Path = DATA) -> Workload:
    """The workload ``name`` (``WORKLOADS``) of about ``n`` requests."""
    build = {"multi_turn": multi_turn, "fewshot": fewshot, "system_prompt": system_prompt, "unique": unique}[name]
    return build(n, seed, data)


def cpu_check(data: Path = DATA, n: int = 192, templates: int = 8, seed: int = 0) -> Workload:
    """docs/benchmarks.md's ``affinity --engine vllm`` batch: BBH direct prompts of ``templates``
    templates, shuffled as ``benchmarks/prefix_bench.py`` does, ``max_tokens=1``."""
    rows = _jsonl(data / "prefix" / "bbh_fewshot_direct.jsonl.gz")
    rng = random.Random(seed)  # benchmarks/prefix_bench.py's load(), exactly
    groups = sorted({str(r["group"]) for r in rows})
    keep = set(rng.sample(groups, min(templates, len(groups))))
    chosen = [r for r in rows if r["group"] in keep]
    rng.shuffle(chosen)
    specs = [Spec(str(r["prompt"]), 1) for r in chosen[:n]]
    return Workload("cpu_check", specs, [0.0] * len(specs))
