"""Fit the jailbreak and prompt-injection head (:mod:`classifiers.jailbreak`) and measure it.

Rows: the public labeled sets derived into one file by ``python -m benchmarks guardrail-data``
(attacks: in-the-wild jailbreaks, DAN prompts, system-prompt extraction, prompt injections,
GPTFuzzer and JailbreakBench prompts; benign: role-play and task prompts), each with its ``dev``
or ``test`` split; and benign prompts of the shared data (intents: their ``train`` rows to fit,
``test`` to report; MT-Bench and Arena-Hard: a seeded 30% test, the rest dev) and the developers'
prompts the injection head already treats as hard negatives.

The head is a balanced logistic regression on :func:`classifiers.jailbreak.features`, its
temperature fitted on held-back rows. Its cut is fitted to a false-positive rate (``target_fpr``,
1%) on benign dev rows held out of the fit (``CUT_SHARE`` of them, by a hash of their ids), in each
group of them (intents, MT-Bench and Arena-Hard, role-play prompts, developers' prompts): the
highest of the groups' ``1 - target_fpr`` quantiles of P(attack), so that no kind of benign prompt
is flagged more often than that. Test rows are only measured.

``python -m classifiers.training.jailbreak_training --sets FILE --out DIR`` (the shipped head:
``--out policies/examples/heads``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from classifiers import datasets
from classifiers.calibration import auroc
from classifiers.heads import LinearHead
from classifiers.injection_negatives import developer_prompts, hard_negatives
from classifiers.jailbreak import ATTACK, BENIGN, JAILBREAK, features, jailbreak_probability
from classifiers.training.fit import fit_head, held_back

if TYPE_CHECKING:
    from classifiers.training.embedding_cache import EmbeddingCache

TARGET_FPR = 0.01
CUT_SHARE = 0.3
INTENT_SETS = ("clinc150", "banking77", "hwu64")
OPEN_SETS = ("mt_bench", "arena_hard_v0.1")
INTENT_CAP = 700  # rows per intent set and split (thousands of near-identical one-liners otherwise)
CACHE = "-guardrails"  # the readings of these rows kept apart from the heads' (embedding_cache suffix)


@dataclass
class Labeled:
    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def add(self, text: str, label: str, source: str, id_: str) -> None:
        self.texts.append(text)
        self.labels.append(label)
        self.sources.append(source)
        self.ids.append(id_)


def rows(sets: Path, data_dir: Path, split: str) -> Labeled:
    """The public sets' rows of ``split`` and the shared data's benign prompts of the same side."""
    out = Labeled()
    with gzip.open(sets, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            if row["split"] == split:
                out.add(row["text"], row["label"], row["source"], f"{row['source']}-{i}")
    for name in INTENT_SETS:
        r = datasets.task(datasets.find(data_dir, "intent", name), "train" if split == "dev" else "test")
        r = datasets.subsample(r, INTENT_CAP, f"jailbreak-{name}-{split}")
        for text, id_ in zip(r.texts, r.ids, strict=True):
            out.add(text, BENIGN, "intents", id_)
    for name in OPEN_SETS:
        for row in datasets.read_jsonl(datasets.find(data_dir, "open", name)):
            if _open_split(row["id"]) == split:
                out.add(row["prompt"], BENIGN, "open", row["id"])
    if split == "dev":  # developers' prompts with an injection's words in their technical sense
        for made in (hard_negatives(), developer_prompts()):
            for text, id_ in zip(made.texts, made.ids, strict=True):
                out.add(text, BENIGN, "developer", id_)
    return out


def _open_split(id_: str) -> str:
    return "test" if datasets._bucket(id_, "triage-open-split") < 0.3 else "dev"


@dataclass
class JailbreakFit:
    head: LinearHead
    test: dict[str, float]  # auroc, tpr and fpr at the cut, per source too


def fit_jailbreak(cache: EmbeddingCache, sets: Path, data_dir: Path, target_fpr: float = TARGET_FPR) -> JailbreakFit:
    dev = rows(sets, data_dir, "dev")
    x = np.stack([features(r) for r in cache.read(dev.texts)])
    benign = np.array([label == BENIGN for label in dev.labels])
    cut_rows = benign & held_back(dev.ids, CUT_SHARE, "triage-jailbreak-cut")
    keep = ~cut_rows
    head, _ = fit_head(
        JAILBREAK,
        x[keep],
        [lab for lab, k in zip(dev.labels, keep, strict=True) if k],
        [i for i, k in zip(dev.ids, keep, strict=True) if k],
        balanced=True,
        classes=(BENIGN, ATTACK),
    )
    scores = head.proba(x)[:, head.classes.index(ATTACK)]
    groups = sorted({s for s, c in zip(dev.sources, cut_rows, strict=True) if c})
    held = {g: scores[cut_rows & (np.array(dev.sources) == g)] for g in groups}
    cut = max(float(np.quantile(v, 1.0 - target_fpr)) for v in held.values())  # the rate on every group
    sources = sorted(set(dev.sources))
    head.meta.update(
        threshold=cut,
        target_fpr=target_fpr,
        cut_rows={g: len(v) for g, v in held.items()},
        features="embedding+guard_layer",
        sets={s: int(sum(1 for x_ in dev.sources if x_ == s)) for s in sources},
        trained="python -m classifiers.training.jailbreak_training",
    )
    return JailbreakFit(head, measure(cache, head, rows(sets, data_dir, "test")))


def measure(cache: EmbeddingCache, head: LinearHead, test: Labeled) -> dict[str, float]:
    """AUROC over the test rows, and the share flagged at the head's cut per source."""
    p = np.array([jailbreak_probability(head, r) for r in cache.read(test.texts)])
    y = np.array([label == ATTACK for label in test.labels])
    cut = float(head.meta["threshold"])
    out = {"auroc": auroc(p, y), "tpr": float((p[y] >= cut).mean()), "fpr": float((p[~y] >= cut).mean())}
    out["tpr_at_1pct_fpr_test"] = float((p[y] > np.quantile(p[~y], 0.99)).mean())
    for source in sorted(set(test.sources)):
        mask = np.array([s == source for s in test.sources])
        out[f"flagged[{source}]"] = float((p[mask] >= cut).mean())
    out["rows"] = float(len(test.texts))
    return out


def main(argv: list[str] | None = None) -> None:
    from classifiers.training.embedding_cache import embedding_cache
    from policies.schema import ClassifierSpec

    ap = argparse.ArgumentParser(description="Fit the jailbreak head on the public sets' dev rows.")
    ap.add_argument("--sets", type=Path, required=True, help="benchmarks/data/jailbreak_sets.jsonl.gz")
    ap.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    ap.add_argument(
        "--out", type=Path, required=True, help="where the head goes (the shipped: policies/examples/heads)"
    )
    ap.add_argument("--fpr", type=float, default=TARGET_FPR, help="false-positive rate on benign dev rows")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cache = embedding_cache(ClassifierSpec(data_dir=str(args.data), artifacts=str(args.out)), args.threads, CACHE)
    fit = fit_jailbreak(cache, args.sets, args.data, args.fpr)
    cache.save()
    fit.head.save(args.out)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), **fit.test}, indent=2))


if __name__ == "__main__":
    main()
