"""``python -m benchmarks guardrails``: the guardrails' quality on held-out rows and their cost.

- **jailbreak / prompt injection**: the shipped head (``policies/examples/heads/jailbreak.*``) on
  the test rows of the public sets (``benchmarks/data/jailbreak_sets.jsonl.gz``) and of the shared
  data's benign prompts (intents' test rows, MT-Bench and Arena-Hard's seeded 30%): AUROC, the
  true-positive rate at 1% false positives (the cut at the test benign rows' 99th percentile) and at
  the shipped cut (fitted on dev rows), per set. Beside it: the router-aimed ``injection`` head
  (P(router), the existing guard), and TF-IDF + logistic regression fitted on the same dev rows (no
  public pretrained classifier installs from PyPI with its weights: those found fetch them from a
  model hub at first use).
- **PII**: recall and precision per kind on presidio-research's synthetic sentences
  (``benchmarks/data/pii_presidio_synth.jsonl.gz``; a found value counts when it overlaps a labeled
  value of its kind).
- **cost**: the input guardrails' work for one 32-token chat request in process (the layer's
  ``screen_input`` with a PII and a jailbreak guardrail, the reading reused as the router's; and
  its parts: the PII finder, the head on a reading); the same end to end on a real gateway
  (uvicorn, a scripted engine, a ``semantic`` model routed by the encoder), guardrails against
  none, one request of each in turn (on a loaded 2-core machine the difference is within the
  noise); and the output check's cost per streamed chunk (a PII guardrail over a 400-chunk stream
  against the stream alone).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import guardrail_data
from benchmarks.overhead import machine
from classifiers.calibration import auroc
from classifiers.jailbreak import ATTACK, SHIPPED_HEADS, jailbreak_probability, load_head
from classifiers.pii import PiiFinder
from classifiers.training.jailbreak_training import CACHE, rows

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PII_KINDS = {
    "EMAIL_ADDRESS": "email",
    "PHONE_NUMBER": "phone",
    "CREDIT_CARD": "credit_card",
    "IBAN_CODE": "iban",
    "US_SSN": "national_id",
    "IP_ADDRESS": "ip_address",
}
PROMPT_32 = (  # 32 of the encoder's tokens with [CLS] and [SEP]
    "Could you summarise the main economic and political causes of the French Revolution in three short "
    "bullet points for my European history class tomorrow morning, please?"
)


def _rate_at(p: np.ndarray, y: np.ndarray, cut: float) -> float:
    return float((p[y] > cut).mean()) if y.any() else float("nan")


def jailbreak_quality(data: Path, threads: int) -> dict[str, Any]:
    from classifiers.guard import router_probability
    from classifiers.heads import LinearHead
    from classifiers.training.embedding_cache import embedding_cache
    from policies.schema import ClassifierSpec

    head = load_head([SHIPPED_HEADS])
    cache = embedding_cache(ClassifierSpec(data_dir=str(data), artifacts=str(SHIPPED_HEADS)), threads, CACHE)
    test = rows(guardrail_data.JAILBREAK_FILE, data, "test")
    readings = cache.read(test.texts)
    y = np.array([label == ATTACK for label in test.labels])
    sources = np.array(test.sources)
    p = np.array([jailbreak_probability(head, r) for r in readings])
    injection = LinearHead.load(SHIPPED_HEADS, "injection")
    p_router = np.array([router_probability(injection, r) for r in readings])
    dev = rows(guardrail_data.JAILBREAK_FILE, data, "dev")
    p_tfidf = _tfidf(dev.texts, [label == ATTACK for label in dev.labels], test.texts)
    cache.save()
    out: dict[str, Any] = {"rows": {"attack": int(y.sum()), "benign": int((~y).sum())}}
    for name, scores in (("jailbreak head", p), ("injection head (router-aimed)", p_router), ("tf-idf + LR", p_tfidf)):
        at1 = float(np.quantile(scores[~y], 0.99))
        out[name] = {
            "auroc": round(auroc(scores, y), 4),
            "tpr_at_1pct_fpr": round(_rate_at(scores, y, at1), 4),
            "tpr_by_set_at_1pct_fpr": {
                s: round(_rate_at(scores[sources == s], y[sources == s], at1), 3) for s in sorted(set(sources[y]))
            },
        }
    cut = float(head.meta["threshold"])
    out["jailbreak head"]["shipped_cut"] = {
        "threshold": round(cut, 4),
        "target_fpr_on_dev": head.meta.get("target_fpr"),
        "tpr": round(float((p[y] >= cut).mean()), 4),
        "fpr": round(float((p[~y] >= cut).mean()), 4),
        "flagged_by_set": {s: round(float((p[sources == s] >= cut).mean()), 3) for s in sorted(set(sources))},
    }
    return out


def _tfidf(texts: list[str], labels: list[bool], test: list[str]) -> np.ndarray:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=50_000, sublinear_tf=True)
    model = LogisticRegression(C=4.0, max_iter=2000, class_weight="balanced")
    model.fit(vec.fit_transform(texts), labels)
    return np.asarray(model.predict_proba(vec.transform(test))[:, 1])


def pii_quality(regions: list[str]) -> dict[str, Any]:
    finder = PiiFinder(regions=regions)
    with gzip.open(guardrail_data.PII_FILE, "rt", encoding="utf-8") as f:
        labeled = [json.loads(line) for line in f]
    counts = {k: {"gold": 0, "found": 0, "recalled": 0, "right": 0} for k in PII_KINDS.values()}
    for row in labeled:
        gold = [(a, b, PII_KINDS[t]) for a, b, t in row["spans"] if t in PII_KINDS]
        found = finder.find(row["text"])
        for a, b, kind in gold:
            counts[kind]["gold"] += 1
            counts[kind]["recalled"] += any(s.entity == kind and s.start < b and a < s.end for s in found)
        for s in found:
            counts[s.entity]["found"] += 1
            right = any(kind == s.entity and s.start < b and a < s.end for a, b, kind in gold)
            counts[s.entity]["right"] += right  # a find inside another kind's value (an address's digits) is wrong
    out: dict[str, Any] = {"rows": len(labeled), "regions": regions}
    for kind, c in counts.items():
        out[kind] = {
            **c,
            "recall": round(c["recalled"] / c["gold"], 3) if c["gold"] else None,
            "precision": round(c["right"] / c["found"], 3) if c["found"] else None,
        }
    gold, found = sum(c["gold"] for c in counts.values()), sum(c["found"] for c in counts.values())
    out["all"] = {
        "recall": round(sum(c["recalled"] for c in counts.values()) / gold, 3),
        "precision": round(sum(c["right"] for c in counts.values()) / max(1, found), 3),
    }
    return out


def parts(threads: int) -> dict[str, float]:
    """The input checks' own work at 32 tokens, in process (microseconds, median of 2,000)."""
    from classifiers.artifacts import ExportSettings
    from classifiers.encoder import Encoder, EncoderSettings

    head = load_head([SHIPPED_HEADS])
    reading = Encoder.load(EncoderSettings(intra_op_threads=threads), export=ExportSettings()).read([PROMPT_32])[0]
    finder = PiiFinder(regions=["US", "GB", "DE", "FR"])
    out = {}
    for name, fn in (
        ("pii_find_us", lambda: finder.find(PROMPT_32)),
        ("head_us", lambda: jailbreak_probability(head, reading)),
    ):
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 1)
    return out


def _policy(guardrails: bool) -> str:
    rails = (
        """guardrails:
  checks:
    pii: {type: pii, action: mask}
    jailbreak: {type: jailbreak}
"""
        if guardrails
        else ""
    )
    return f"""version: 1
classifier:
  artifacts: {SHIPPED_HEADS}
  encoder: {{precision: int8, threads: 1, max_tokens: 256, batch_max_size: 16, batch_max_wait_ms: 0}}
  heads: [question_type, category, reasoning, injection]
  tasks:
    intents: {{data: intent/clinc150.jsonl.gz, out_of_scope: oos}}
backends:
  s: {{type: scripted, text: "ok"}}
models:
  m: {{backend: s}}
virtual_models:
  routed: {{type: semantic, default: m, min_confidence: 0.5, escalate_to: m, unfamiliar: m, injection: m}}
{rails}"""


def added_p50(rounds: int, requests: int, tmp: Path) -> dict[str, Any]:
    """Sequential chat requests to ``routed`` at 32 tokens: p50 with the input guardrails against none."""
    import uvicorn

    from benchmarks.procs import free_port
    from gateway.http.app import create_app
    from gateway.http.settings import Settings

    urls, servers = {}, []
    for name, on in (("none", False), ("guarded", True)):
        path = tmp / f"bench-guardrails-{name}.yaml"
        path.write_text(_policy(on))
        app = create_app(Settings(policy_path=path, watch_policy=False, handle_sighup=False, configure_logging=False))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        servers.append(server)
        urls[name] = f"http://127.0.0.1:{port}"
    body = {"model": "routed", "messages": [{"role": "user", "content": PROMPT_32}]}
    times: dict[str, list[float]] = {n: [] for n in urls}
    with httpx.Client(timeout=30) as client:
        for url in urls.values():  # warm: the encoder, the heads, the connection
            for _ in range(20):
                client.post(url + "/v1/chat/completions", json=body).raise_for_status()
        for i in range(rounds * requests):  # one of each in turn, the order alternating: pairs
            for name in list(urls)[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                client.post(urls[name] + "/v1/chat/completions", json=body).raise_for_status()
                times[name].append(time.perf_counter() - t0)
    for server in servers:
        server.should_exit = True
    p50 = {n: statistics.median(t) * 1000 for n, t in times.items()}
    pairs = [(g - n) * 1000 for g, n in zip(times["guarded"], times["none"], strict=True)]
    return {
        "p50_ms": {n: round(v, 3) for n, v in p50.items()},
        "added_p50_ms": round(p50["guarded"] - p50["none"], 3),
        "median_paired_difference_ms": round(statistics.median(pairs), 3),
        "requests_each": len(times["none"]),
    }


async def _screen_input_us(threads: int, n: int = 2000) -> dict[str, float]:
    """The layer's input work for one 32-token chat request, the reading reused (as the router's):
    the PII guardrail (mask) and the jailbreak guardrail, median microseconds."""
    from types import MappingProxyType, SimpleNamespace

    from classifiers.artifacts import ExportSettings
    from classifiers.encoder import Encoder, EncoderSettings
    from gateway.service.context import Context
    from gateway.service.guardrails.checks import Guardrails, Tally
    from gateway.service.guardrails.layer import screen_input
    from gateway.service.job import Job
    from policies.guardrails import Vault
    from policies.schema_guardrails import GuardrailsSpec

    head = load_head([SHIPPED_HEADS])
    reading = Encoder.load(EncoderSettings(intra_op_threads=threads), export=ExportSettings()).read([PROMPT_32])[0]

    class Recent:
        async def read(self, text: str) -> Any:
            return reading

    spec = GuardrailsSpec.model_validate({"checks": {"pii": {"type": "pii"}, "jailbreak": {"type": "jailbreak"}}})
    guards = Guardrails(spec, {"jailbreak": (head, float(head.meta["threshold"]))}, Tally())
    rt: Any = SimpleNamespace(encoding=Recent())
    job = Job("chat", MappingProxyType({"model": "m", "messages": [{"role": "user", "content": PROMPT_32}]}), "m", None)
    names = guards.names(Context("bench"))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await screen_input(rt, guards, names, job, Context("bench"), Vault())
        times.append(time.perf_counter() - t0)
    return {"screen_input_us": round(statistics.median(times) * 1e6, 1)}


async def _stream_cost(chunks: int, repeats: int) -> dict[str, float]:
    from backends.base import ChunkStream
    from gateway.service.context import Context
    from gateway.service.guardrails.checks import Guardrails, Tally
    from gateway.service.guardrails.layer import GuardedStream
    from policies.guardrails import Vault
    from policies.schema_guardrails import GuardrailsSpec

    spec = GuardrailsSpec.model_validate({"checks": {"out": {"type": "pii", "stage": "output", "restore": False}}})
    guards = Guardrails(spec, {}, Tally())
    words = ("The answer is that the river floods every spring, so the town built a levee. " * 40).split(" ")

    def stream() -> ChunkStream:
        made = [{"choices": [{"index": 0, "delta": {"content": w + " "}}]} for w in words[:chunks]]
        made.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})

        async def rest() -> AsyncIterator[dict[str, Any]]:
            for c in made[1:]:
                yield c

        return ChunkStream(made[0], rest(), "r")

    async def drain(s: ChunkStream) -> float:
        t0 = time.perf_counter()
        async for _ in s:
            pass
        return time.perf_counter() - t0

    plain, guarded = [], []
    for _ in range(repeats):
        plain.append(await drain(stream()))
        guarded.append(await drain(GuardedStream(stream(), guards, ["out"], Context("bench"), Vault(), "chat")))
    per = (statistics.median(guarded) - statistics.median(plain)) / (chunks + 1)
    return {"chunks": chunks + 1, "us_per_chunk": round(per * 1e6, 2), "hold_chars": spec.hold_chars}


def run(
    data: Path = DATA, threads: int = 1, rounds: int = 6, requests: int = 100, out: Path | None = None
) -> dict[str, Any]:
    import tempfile

    result: dict[str, Any] = {"machine": machine()}
    result["jailbreak"] = jailbreak_quality(data, threads)
    result["pii"] = pii_quality(["US", "GB", "DE", "FR"])  # the schema's default regions
    result["pii_us_gb"] = pii_quality(["US", "GB"])
    result["parts_us"] = parts(threads)
    result["parts_us"].update(asyncio.run(_screen_input_us(threads)))
    result["output_stream"] = asyncio.run(_stream_cost(400, 30))
    with tempfile.TemporaryDirectory() as tmp:
        result["input_added"] = added_p50(rounds, requests, Path(tmp))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result
