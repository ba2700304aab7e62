"""`/v1/embeddings` against sentence-transformers' `encode`, in the same run, on the same texts and
batch sizes: texts per second, and (fp32) the cosine of each vector to sentence-transformers'.

    .venv/bin/python benchmarks/embeddings.py --policy policies/examples/cascade.yaml [--precision int8]

The gateway (`triage serve` on the policy, with its encoder set to `--precision` and `--threads`)
runs in its own process; the official `openai` client sends the requests, one batch at a time,
and `--clients` of them at once for batch size 1. sentence-transformers (PyTorch, the same
packaged MiniLM weights) encodes the same batches in this process at the same thread count. Rounds
alternate between the two so the machine's noise falls on both. Prints the ratios; writes JSON
with --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
from ruamel.yaml import YAML

from classifiers.artifacts import source_dir
from eval.tier_outputs import read_jsonl


def texts(data: Path, n: int) -> list[str]:
    rows = [d["question"] for _, d in read_jsonl(data) if isinstance(d.get("question"), str)]
    return rows[:n]


def start_gateway(policy: Path, precision: str, threads: int, port: int) -> tuple[subprocess.Popen, Path]:
    yaml = YAML()
    doc = yaml.load(policy.read_text())
    doc["classifier"]["encoder"] = {**doc["classifier"].get("encoder", {}), "precision": precision, "threads": threads}
    for key in ("data_dir", "artifacts"):
        doc["classifier"][key] = str((policy.parent / doc["classifier"][key]).resolve())
    doc.pop("cascade", None)  # the encoder only: no model is loaded beside it
    doc["virtual_models"] = {}
    doc["backends"] = {"echo": {"type": "scripted", "echo": True}}
    doc["models"] = {"echo": {"backend": "echo"}}
    tmp = Path(tempfile.mkdtemp()) / "policy.yaml"
    with tmp.open("w") as f:
        yaml.dump(doc, f)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, tmp
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the gateway did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", type=Path, required=True, help="a policy with a classifier (its trained heads)")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/typed/commonsenseqa.jsonl"))
    ap.add_argument("--precision", choices=("int8", "fp32"), default="int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients for batch size 1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    st = SentenceTransformer(str(source_dir()), device="cpu")
    corpus = texts(args.data, args.texts)
    proc, _ = start_gateway(args.policy, args.precision, args.threads, args.port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0)
    model = "all-minilm-l6-v2"
    try:
        client.embeddings.create(model=model, input=corpus[:4])  # warm
        st.encode(corpus[:4])
        results: dict[str, dict[str, list[float]]] = {}
        for b in args.batches:
            chunks = [corpus[i : i + b] for i in range(0, len(corpus), b)]
            times: dict[str, list[float]] = {"gateway": [], "sentence-transformers": []}
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                if b == 1 and args.clients > 1:
                    with ThreadPoolExecutor(args.clients) as pool:
                        list(pool.map(lambda c: client.embeddings.create(model=model, input=c), chunks))
                else:
                    for c in chunks:
                        client.embeddings.create(model=model, input=c)
                times["gateway"].append(len(corpus) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for c in chunks:
                        st.encode(c, batch_size=len(c), convert_to_numpy=True, show_progress_bar=False)
                times["sentence-transformers"].append(len(corpus) / (time.perf_counter() - t0))
            results[str(b)] = times
            g, s = np.median(times["gateway"]), np.median(times["sentence-transformers"])
            print(f"batch {b:>3}: gateway {g:8.1f} texts/s  sentence-transformers {s:8.1f} texts/s  ratio {g / s:.2f}")
        got = np.array([d.embedding for d in client.embeddings.create(model=model, input=corpus[:64]).data])
        ref = st.encode(corpus[:64], convert_to_numpy=True, normalize_embeddings=True)
        cos = (got * ref).sum(axis=1)
        print(f"cosine to sentence-transformers ({args.precision}): min {cos.min():.4f}, mean {cos.mean():.4f}")
    finally:
        proc.terminate()
        proc.wait(30)
    if args.out is not None:
        doc = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": platform.processor() or platform.machine(),
            "precision": args.precision,
            "threads": args.threads,
            "texts": len(corpus),
            "clients_at_batch_1": args.clients,
            "texts_per_s": results,
            "cosine_min": float(cos.min()),
            "cosine_mean": float(cos.mean()),
        }
        args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
