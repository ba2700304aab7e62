"""What the learned router adds to the encoder's decision time: per prompt, the encoder's pass
(one prompt, one thread, as served) and the router's step (quality heads, pruning, the choice),
timed interleaved in the same run so that the machine's noise falls on both.

    .venv/bin/python benchmarks/router_overhead.py --policy policies/examples/router.yaml --model gpt4-or-mixtral

The quality head is fitted here on the labels file's dev rows (as `triage train` fits it); the
prompts timed are test rows. Prints p50/p90 of each and the ratio; writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from classifiers.encoder import Encoder, EncoderSettings
from classifiers.service import data_dir
from classifiers.training.export import ensure_exported
from classifiers.training.quality_training import fit_quality
from classifiers.training.router_training import labels_for
from classifiers.training.train_all import embedding_cache
from gateway.service.encoding import quality_route
from policies import loader
from policies.routed import candidate_costs, prompt_tokens
from policies.schema import RoutedModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--model", required=True, help="a routed virtual model of the policy")
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pol = loader.load(args.policy)
    vm = pol.virtual_models[args.model]
    assert isinstance(vm, RoutedModel) and pol.classifier is not None
    labels = labels_for(vm, data_dir(pol.classifier, args.policy.resolve().parent))
    dev, test = labels.split("dev"), labels.split("test")
    cache = embedding_cache(pol.classifier, threads=2, suffix="-labels")
    fit = fit_quality(
        args.model,
        labels.models,
        cache.embed(dev.texts),
        dev.correct,
        dev.ids,
        learners=vm.learners,
        categories=dev.categories,
        cost=candidate_costs(pol, vm, prompt_tokens(dev.texts)),
    )
    cache.save()
    head = fit.head
    e = pol.classifier.encoder
    art, _ = ensure_exported()
    encoder = Encoder.load(
        EncoderSettings(precision=e.precision, intra_op_threads=1, max_tokens=e.max_tokens, rows=e.rows), artifacts=art
    )
    rng = np.random.default_rng(0)
    prompts = [test.texts[i] for i in rng.choice(len(test), size=min(args.prompts, len(test)), replace=False)]
    encoder.read([prompts[0]])  # warm-up
    enc_ms, route_ms = [], []
    for text in prompts:
        t0 = time.perf_counter()
        [reading] = encoder.read([text])
        t1 = time.perf_counter()
        quality_route(pol, vm, head, reading, max(1, len(text) // 4))
        t2 = time.perf_counter()
        enc_ms.append((t1 - t0) * 1000)
        route_ms.append((t2 - t1) * 1000)
    enc, route = np.array(enc_ms), np.array(route_ms)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "policy": str(args.policy),
        "model": args.model,
        "learner": f"{head.meta['learner']} {head.meta['setting']}",
        "candidates": len(vm.candidates),
        "prompts": len(prompts),
        "encoder_p50_ms": float(np.median(enc)),
        "encoder_p90_ms": float(np.quantile(enc, 0.9)),
        "router_p50_ms": float(np.median(route)),
        "router_p90_ms": float(np.quantile(route, 0.9)),
        "router_share_of_encoder_p50": float(np.median(route) / np.median(enc)),
    }
    print(
        f"{args.model} ({doc['candidates']} candidates, {doc['learner']}), {len(prompts)} test prompts, one at a "
        f"time: encoder p50 {doc['encoder_p50_ms']:.2f} ms (p90 {doc['encoder_p90_ms']:.2f}), router p50 "
        f"{doc['router_p50_ms']:.3f} ms (p90 {doc['router_p90_ms']:.3f}): "
        f"{doc['router_share_of_encoder_p50']:.1%} of the encoder's p50 (goal <= 10%)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
