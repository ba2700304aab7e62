"""Fit the semantic cache's hit rule (:class:`policies.semantic_cache.Rule`) to a false-hit budget,
and measure it, by replaying labelled intent sets through the cache.

Simulation protocol (one stream per set and split):

- a split's rows in a seeded order: ascending SHA-256 of the row's id (no RNG), the cache
  (one :class:`SemanticIndex`, capacity above the stream's length: no eviction) starting empty;
- each row: look up its embedding (the served encoder's, the last user turn = the row's text);
  when the rule accepts the nearest entry it is a hit (right iff the entry's label is the row's;
  the row is not inserted), else a miss and the row is inserted with its label as its group;
- hit rate = hits / rows; false-hit rate = wrong hits / hits.

Labels: a hit is right when the cached request's intent label equals the new one's (as
semantic-cache benchmarks do, e.g. vCache's classification benchmark), except CLINC150's
out-of-scope rows (label ``oos``): each is a group of its own, so a hit by or on one is wrong
(two out-of-scope requests rarely share an answer).

Tuning rows: CLINC150 ``dev``; BANKING77 and HWU64 have no dev split, their ``train`` rows are
the tuning rows. Test rows only report. One rule is fitted over the pooled tuning streams.

Fitting replays the tuning streams many times; it uses :class:`Replay`, which precomputes each
row's nearest earlier rows once and reads the cache's contents off them (exact: it falls back to
a full product when the precomputed candidates do not settle a lookup); :func:`simulate` replays
with the real :class:`SemanticIndex` (the numbers reported on test rows).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import beta

from policies.semantic_cache import KINDS, NEIGHBOURS, Neighbours, Rule, SemanticIndex

SETS = {"clinc150": "clinc150.jsonl.gz", "banking77": "banking77.jsonl.gz", "hwu64": "hwu64.jsonl"}
TUNING = {"clinc150": "dev", "banking77": "train", "hwu64": "train"}
OUT_OF_SCOPE = "oos"
CANDIDATES = 48  # earlier rows kept per row by Replay


@dataclass(frozen=True)
class Stream:
    name: str  # "clinc150/dev"
    vectors: np.ndarray  # (n, dim) float32, L2-normalised, in stream order
    groups: np.ndarray  # (n,) int64: the label's index; out-of-scope rows a negative group each


@dataclass(frozen=True)
class Outcome:
    rows: int
    hits: int
    wrong: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows if self.rows else 0.0

    @property
    def false_hit_rate(self) -> float:
        return self.wrong / self.hits if self.hits else 0.0

    def __add__(self, o: Outcome) -> Outcome:
        return Outcome(self.rows + o.rows, self.hits + o.hits, self.wrong + o.wrong)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "rows": self.rows,
            "hits": self.hits,
            "wrong": self.wrong,
            "hit_rate": round(self.hit_rate, 5),
            "false_hit_rate": round(self.false_hit_rate, 5),
        }


def total(outcomes: Iterable[Outcome]) -> Outcome:
    return sum(outcomes, Outcome(0, 0, 0))


def upper_bound(o: Outcome, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound of the false-hit rate; the point estimate at confidence 0."""
    if o.hits == 0:
        return 0.0
    if confidence <= 0:
        return o.false_hit_rate
    return 1.0 if o.wrong >= o.hits else float(beta.ppf(confidence, o.wrong + 1, o.hits - o.wrong))


# ---- data -------------------------------------------------------------------------------------


def read_rows(data: Path, name: str) -> list[dict[str, str]]:
    path = data / "intent" / SETS[name]
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        return [json.loads(line) for line in f]


def seeded(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return sorted(rows, key=lambda r: hashlib.sha256(r["id"].encode()).digest())


def streams(data: Path, embed: Callable[[list[str]], np.ndarray], split: str) -> list[Stream]:
    """The three sets' streams of ``split`` ("tuning" or "test")."""
    out = []
    for name in SETS:
        rows = read_rows(data, name)
        labels = sorted({r["label"] for r in rows})
        part = TUNING[name] if split == "tuning" else split
        chosen = seeded([r for r in rows if r["split"] == part])
        vectors = np.ascontiguousarray(embed([r["text"] for r in chosen]), dtype=np.float32)
        groups = np.array(
            [-(i + 1) if r["label"] == OUT_OF_SCOPE else labels.index(r["label"]) for i, r in enumerate(chosen)],
            dtype=np.int64,
        )
        out.append(Stream(f"{name}/{part}", vectors, groups))
    return out


# ---- replay -----------------------------------------------------------------------------------


def simulate(rule: Rule, stream: Stream) -> Outcome:
    """The protocol with the real index."""
    index = SemanticIndex(stream.vectors.shape[1], max(1, len(stream.groups)))
    hits = wrong = 0
    for v, g in zip(stream.vectors, stream.groups, strict=True):
        n = index.nearest(v)
        if n is not None and rule.accepts(n):
            hits += 1
            wrong += int(n.group != g)
        else:
            index.add(v, int(g))
    return Outcome(len(stream.groups), hits, wrong)


class Replay:
    """A stream prepared for many replays: each row's ``CANDIDATES`` most similar earlier rows."""

    def __init__(self, stream: Stream, block: int = 1024) -> None:
        self.stream = stream
        x, n = stream.vectors, len(stream.groups)
        self.groups = stream.groups.tolist()
        self.cand: list[list[int]] = []
        self.csim: list[list[float]] = []
        for i0 in range(0, n, block):
            i1 = min(n, i0 + block)
            s = x[i0:i1] @ x[:i1].T
            s[np.triu_indices(i1 - i0, k=i0, m=i1)] = -np.inf  # only earlier rows
            k = min(CANDIDATES, i1)
            top = np.argpartition(-s, k - 1, axis=1)[:, :k]
            ts = np.take_along_axis(s, top, axis=1)
            order = np.argsort(-ts, axis=1, kind="stable")
            top, ts = np.take_along_axis(top, order, axis=1), np.take_along_axis(ts, order, axis=1)
            for r in range(i1 - i0):
                keep = np.isfinite(ts[r])
                self.cand.append(top[r][keep].tolist())
                self.csim.append(ts[r][keep].tolist())

    def _exact(self, i: int, inserted: bytearray) -> Neighbours | None:
        idx = np.flatnonzero(np.frombuffer(bytes(inserted[:i]), dtype=np.uint8))
        if len(idx) == 0:
            return None
        sims = self.stream.vectors[idx] @ self.stream.vectors[i]
        g = self.stream.groups[idx]
        k = min(NEIGHBOURS, len(idx))
        top = np.argsort(-sims, kind="stable")[:k]
        best, same = int(top[0]), g[top] == g[top[0]]
        other = sims[g != g[best]]
        return Neighbours(
            int(idx[best]), float(sims[best]), int(g[best]), float(other.max()) if len(other) else -1.0,
            int(same.sum()), k, len(idx),
        )  # fmt: skip

    def _lookup(self, i: int, inserted: bytearray, rule: Rule) -> Neighbours | None:
        """The lookup read off the candidates where they settle the rule's answer, else exact."""
        groups, cand, sims = self.groups, self.cand[i], self.csim[i]
        near, other, agree, seen = -1, -1.0, 0, 0
        found = False  # an entry of another group among the candidates
        for pos, j in enumerate(cand):
            if not inserted[j]:
                continue
            if near < 0:
                near = pos
            seen += 1
            same = groups[j] == groups[cand[near]]
            agree += same and seen <= NEIGHBOURS
            if not same and not found:
                found, other = True, sims[pos]
            if found and (seen >= NEIGHBOURS or rule.kind != "vote"):
                break
        if near < 0:  # nothing inserted among the candidates
            return None if len(cand) == i else self._exact(i, inserted)
        j0 = cand[near]  # the nearest inserted row: any row past the candidates is no closer
        if len(cand) < i and (not found or (rule.kind == "vote" and seen < NEIGHBOURS)):
            # unsettled: reject when even the most favourable rest (no other group, all agreeing) is rejected
            agree_up = agree + max(0, NEIGHBOURS - seen)
            hopeful = Neighbours(j0, sims[near], groups[j0], -1.0, agree_up, NEIGHBOURS, seen)
            if not rule.accepts(hopeful):
                return hopeful
            if rule.kind == "vote" and seen < NEIGHBOURS:
                return self._exact(i, inserted)
        if found or len(cand) == i:  # exact: every earlier row is a candidate, or another group was found
            return Neighbours(j0, sims[near], groups[j0], other, agree, min(NEIGHBOURS, seen), seen)
        # no other group among the candidates: other <= the last candidate's similarity (rules are monotone)
        bound = Neighbours(j0, sims[near], groups[j0], sims[-1], agree, min(NEIGHBOURS, seen), seen)
        return bound if rule.accepts(bound) else self._exact(i, inserted)

    def run(self, rule: Rule) -> Outcome:
        n = len(self.groups)
        inserted = bytearray(n)
        hits = wrong = 0
        for i in range(n):
            nb = self._lookup(i, inserted, rule)
            if nb is not None and rule.accepts(nb):
                hits += 1
                wrong += nb.group != self.groups[i]
            else:
                inserted[i] = 1
        return Outcome(n, hits, wrong)


# ---- fitting ----------------------------------------------------------------------------------


def grid(kind: str) -> list[Rule]:
    """The candidate rules of a kind, strictest similarity first within each other setting."""
    sims = [round(float(s), 4) for s in np.arange(0.99, 0.595, -0.01)]
    if kind == "global":
        return [Rule("global", s) for s in sims]
    if kind == "margin":
        return [Rule("margin", s, m) for m in (0.0, 0.02, 0.04, 0.06, 0.08, 0.10) for s in sims]
    if kind == "vote":
        return [Rule("vote", s, m, a) for a in (4, 6, 8) for m in (0.0, 0.02, 0.04) for s in sims]
    raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")


@dataclass(frozen=True)
class Fit:
    rule: Rule
    tuning: Outcome
    bound: float
    tried: int


def fit(kind: str, replays: Sequence[Replay], budget: float, confidence: float = 0.95, patience: int = 3) -> Fit:
    """The rule of ``kind`` with the most tuning hits whose false-hit rate's upper bound (at
    ``confidence``; 0: the point estimate) is within ``budget``. Within one setting of the other
    parameters the similarity is lowered until, once a rule of that setting fitted, ``patience``
    steps in a row have a false-hit rate (the point estimate) above the budget."""
    best: Fit | None = None
    tried, misses, fitted, last_key = 0, 0, False, None
    for rule in grid(kind):
        key = (rule.margin, rule.agree)
        if key != last_key:
            last_key, misses, fitted = key, 0, False
        elif misses >= patience:
            continue
        o = total(r.run(rule) for r in replays)
        tried += 1
        fitted = fitted or upper_bound(o, confidence) <= budget
        misses = misses + 1 if fitted and o.false_hit_rate > budget else 0
        ub = upper_bound(o, confidence)
        if ub > budget:
            continue
        if best is None or o.hits > best.tuning.hits:
            best = Fit(rule, o, ub, tried)
    if best is None:
        return Fit(Rule(kind, 1.01), Outcome(0, 0, 0), 0.0, tried)  # serves nothing
    return Fit(best.rule, best.tuning, best.bound, tried)


# ---- the report -------------------------------------------------------------------------------


def measure(rule: Rule, replays: Sequence[Replay]) -> dict[str, object]:
    per = {r.stream.name: r.run(rule) for r in replays}
    return {"rule": rule.as_dict(), "all": total(per.values()).as_dict(), **{k: v.as_dict() for k, v in per.items()}}


def report(
    tuning: Sequence[Stream],
    test: Sequence[Stream],
    budgets: Sequence[float],
    kinds: Sequence[str] = ("margin", "vote"),
    confidences: Sequence[float] = (0.95, 0.0),
    say: Callable[[str], object] = print,
) -> list[dict[str, object]]:
    """Per budget and confidence: the global threshold and each kind fitted on the tuning rows,
    measured on test rows; the best kind (most tuning hits) against the global threshold tuned on
    the test rows to the best kind's measured false-hit rate."""
    tune, held = [Replay(s) for s in tuning], [Replay(s) for s in test]
    rows: list[dict[str, object]] = []
    for confidence in confidences:
        for budget in budgets:
            fits = {kind: fit(kind, tune, budget, confidence) for kind in ("global", *kinds)}
            best = max(kinds, key=lambda k: fits[k].tuning.hits)
            measured = {kind: measure(f.rule, held) for kind, f in fits.items()}
            rule_test = total(r.run(fits[best].rule) for r in held)
            same = fit("global", held, rule_test.false_hit_rate, confidence=0.0, patience=len(grid("global")))
            same_test = total(r.run(same.rule) for r in held)
            row: dict[str, object] = {
                "budget": budget,
                "confidence": confidence,
                "best": best,
                "fits": {
                    k: {"rule": f.rule.as_dict(), "tuning": f.tuning.as_dict(), "bound": f.bound}
                    for k, f in fits.items()
                },
                "test": measured,
                "global_at_same_rate": {"rule": same.rule.as_dict(), "test": same_test.as_dict()},
                "ratio": rule_test.hits / same_test.hits if same_test.hits else float("inf"),
            }
            rows.append(row)
            say(
                json.dumps({k: row[k] for k in ("budget", "confidence", "best", "ratio")})
                + " "
                + json.dumps(measured[best]["all"])
            )
    return rows
