"""The learned router's choice: per request, the model worth its cost. Pure (numpy only).

Each candidate has a predicted probability of answering right (the quality heads) and an
expected cost (its prices times the request's tokens). Two rules:

- ``utility``: the candidate with the highest ``quality - lam * cost``; ``lam`` is quality points
  per unit of money (0: always the best predicted; large: always the cheapest);
- ``margin``: the cheapest candidate whose predicted quality is within ``margin`` of the best one's.

The knob (``lam`` or ``margin``) is set by a target, fitted on dev rows (:func:`fit_knob`): a share
of calls to the strongest candidate (RouteLLM's measure), a mean cost per request, a quality
floor (accuracy on the dev rows, where labels say which answers were right), or a share of the
strongest candidate's own accuracy (``of_strong=0.95``: RouteLLM's "95% of GPT-4").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Literal

import numpy as np

from policies.schema import GGUFProbeBackendSpec, Policy, RoutedModel

Rule = Literal["utility", "margin"]
TargetKind = Literal["strong_share", "cost", "quality", "of_strong"]
MAX_KNOB = 1e12


@dataclass(frozen=True)
class Target:
    kind: TargetKind
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """``strong_share=0.3``, ``cost=0.002``, ``quality=0.6`` or ``of_strong=0.95``."""
        kind, sep, value = text.partition("=")
        if not sep or kind not in ("strong_share", "cost", "quality", "of_strong"):
            raise ValueError(f"a router target is strong_share=X, cost=X, quality=X or of_strong=X, not {text!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"router target {text!r}: {value!r} is not a number") from None
        if number < 0 or (kind != "cost" and number > 1):
            raise ValueError(f"router target {text!r}: a share or accuracy is between 0 and 1, a cost at least 0")
        return cls(kind, number)  # type: ignore[arg-type]


def prompt_tokens(texts: list[str]) -> np.ndarray:
    """About four characters a token: the gateway's estimate of a prompt's tokens for the expected cost."""
    return np.array([max(1, len(t) // 4) for t in texts], dtype=np.float64)


def expected_costs(prices: np.ndarray, input_tokens: float | np.ndarray, output_tokens: float) -> np.ndarray:
    """Cost of one call per candidate: ``prices`` rows are (input per Mtok, output per Mtok, per call).
    With an array of input tokens, one row of costs per request."""
    p = np.asarray(prices, dtype=np.float64)
    tokens = np.asarray(input_tokens, dtype=np.float64)[..., None]
    return tokens * p[:, 0] / 1e6 + output_tokens * p[:, 1] / 1e6 + p[:, 2]


def prune(quality: np.ndarray, cost: np.ndarray, accuracy: np.ndarray | None) -> np.ndarray:
    """``quality`` with every candidate that is dominated on the dev rows set to -inf (never chosen):
    another candidate was at least as accurate there (``accuracy``, per candidate) and costs no more
    for this request, better on one of the two. With 29 candidates the best *predicted* one is often
    an over-estimated also-ran (the winner's curse of a noisy argmax); the dev rows rule those out
    once, and the policy's prices, read per request, say which are dominated. None: no pruning."""
    q = np.atleast_2d(np.asarray(quality, dtype=np.float64))
    if accuracy is None:
        return q
    a = np.asarray(accuracy, dtype=np.float64)
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), q.shape)
    # [row, j, k]: k dominates j
    better = (a[None, None, :] >= a[None, :, None]) & (c[:, None, :] <= c[:, :, None])
    strict = (a[None, None, :] > a[None, :, None]) | (c[:, None, :] < c[:, :, None])
    dominated = (better & strict).any(axis=2)
    return np.where(dominated, -np.inf, q)


def choose(quality: np.ndarray, cost: np.ndarray, rule: Rule, knob: float) -> np.ndarray:
    """The chosen candidate per row. ``quality``: (rows, models); ``cost``: (models,) or (rows, models).
    Ties go to the cheaper candidate."""
    q = np.atleast_2d(np.asarray(quality, dtype=np.float64))
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), q.shape)
    cheap_first = np.argsort(c, axis=1, kind="stable")
    score = q - knob * c if rule == "utility" else np.where(q >= q.max(axis=1, keepdims=True) - knob, -c, -np.inf)
    ordered = np.take_along_axis(score, cheap_first, axis=1)
    return np.take_along_axis(cheap_first, ordered.argmax(axis=1)[:, None], axis=1)[:, 0]


@dataclass(frozen=True)
class Outcome:
    knob: float
    accuracy: float  # on the rows given, where labels are known (NaN without labels)
    mean_cost: float
    strong_share: float


def outcome(
    quality: np.ndarray, cost: np.ndarray, rule: Rule, knob: float, strongest: int, correct: np.ndarray | None = None
) -> Outcome:
    picked = choose(quality, cost, rule, knob)
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), np.atleast_2d(quality).shape)
    rows = np.arange(len(picked))
    acc = float("nan")
    if correct is not None:
        got = np.asarray(correct, dtype=np.float64)[rows, picked]
        acc = float(np.nanmean(np.nan_to_num(got, nan=0.0)))  # no answer counts as wrong
    return Outcome(knob, acc, float(c[rows, picked].mean()), float((picked == strongest).mean()))


def knob_grid(quality: np.ndarray, cost: np.ndarray, rule: Rule, points: int = 400) -> np.ndarray:
    """Candidate knob values that span every choice from the best predicted to the cheapest: every
    point where a row's choice changes, or, where there are more than ``points`` of them, that many
    quantiles of them."""

    def spread(values: np.ndarray) -> np.ndarray:
        distinct = np.unique(values)
        return distinct if distinct.size <= points else np.quantile(values, np.linspace(0, 1, points))

    q = np.atleast_2d(quality)
    if rule == "margin":
        gaps = q.max(1, keepdims=True) - q
        return np.unique(np.concatenate([[0.0], spread(gaps[np.isfinite(gaps)]), [1.0]]))
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), q.shape)
    with np.errstate(invalid="ignore"):  # pruned candidates are -inf
        dq = (q[:, :, None] - q[:, None, :]).ravel()
    dc = (c[:, :, None] - c[:, None, :]).ravel()
    keep = (dc > 0) & (dq > 0) & np.isfinite(dq)  # a dearer, better candidate: the lam at which the cheaper one wins
    return np.unique(np.concatenate([[0.0], spread(dq[keep] / dc[keep]) * (1 + 1e-9), [MAX_KNOB]]))


FIT_POINTS = 5_000  # fit_knob's grid: every choice point of two candidates on up to 5,000 rows, quantiles beyond


def fit_knob(
    quality: np.ndarray, cost: np.ndarray, rule: Rule, target: Target, strongest: int, correct: np.ndarray | None = None
) -> Outcome:
    """The knob that meets ``target`` on these rows at the least cost (``quality``: the best accuracy
    under the cost; ``cost`` and ``strong_share``: the best accuracy, or the best predicted quality
    without labels, within the budget). Raises ValueError when no knob meets it."""
    if target.kind in ("quality", "of_strong") and correct is None:
        raise ValueError(f"a {target.kind} target needs labelled rows")
    if target.kind == "of_strong":  # the strongest candidate's accuracy on these rows (no answer: wrong), scaled
        assert correct is not None
        strong = float(np.nan_to_num(np.asarray(correct, dtype=np.float64)[:, strongest], nan=0.0).mean())
        target = Target("quality", target.value * strong)
    best: Outcome | None = None
    best_key: tuple[float, float] = (-np.inf, -np.inf)
    q = np.atleast_2d(quality)
    for knob in knob_grid(q, cost, rule, FIT_POINTS):
        o = outcome(q, cost, rule, float(knob), strongest, correct)
        value = (
            o.accuracy
            if correct is not None
            else float(np.take_along_axis(q, choose(q, cost, rule, float(knob))[:, None], axis=1).mean())
        )
        if target.kind == "quality":
            if o.accuracy + 1e-12 < target.value:
                continue
            key = (-o.mean_cost, o.accuracy)
        else:
            spent = o.strong_share if target.kind == "strong_share" else o.mean_cost
            if spent > target.value + 1e-12:
                continue
            key = (value, -o.mean_cost)
        if best is None or key > best_key:
            best, best_key = o, key
    if best is None:
        raise ValueError(f"no setting of the router meets {target.kind}={target.value} on these rows")
    return best


# the probe read the prompt; the call was not close; the probe reads no such prompt (letters: not
# lettered, or empty); the reading failed or was late
ProbeOutcome = Literal["read", "not needed", "not readable", "failed"]


@dataclass(frozen=True)
class QualityChoice:
    """What a routed model chose for one request, and why (the response headers and the log say it)."""

    candidate: int  # index in the virtual model's candidates
    model: str
    reasoning: str | None  # "on", "off" or None (the engine's own)
    quality: float  # predicted P(right) of the chosen candidate
    best_quality: float  # of the candidate predicted best
    strongest_quality: float  # of the dearest candidate (the one a fixed route would pick)
    cost: float  # expected cost of the call (with the probe's reading, where it read)
    predictions: tuple[tuple[str, float, float], ...]  # (candidate label, P(right), expected cost) each
    probe: ProbeOutcome | None = None  # the difficulty probe's part (None: the routed model has none)
    probe_ms: float | None = None  # the reading's time, where the probe was asked


def candidate_label(model: str, reasoning: str | None) -> str:
    return model if reasoning is None else f"{model}+reasoning:{reasoning}"


def price_matrix(policy: Policy, vm: RoutedModel) -> np.ndarray:
    """(candidates, 3): input per Mtok, output per Mtok, per call; reasoning's tokens priced as output."""
    rows = []
    for c in vm.candidates:
        p = policy.models[c.model].prices
        rows.append((p.input_per_mtok, p.output_per_mtok, p.per_call))
    return np.array(rows, dtype=np.float64)


def probe_source(policy: Policy, vm: RoutedModel) -> str:
    """What a probe's head is fitted on, as the policy names it: the gguf_probe backend's file and
    context (a head fitted on another file's readings is stale: the gateway refuses it)."""
    assert vm.probe is not None
    spec = policy.backends[vm.probe.backend]
    assert isinstance(spec, GGUFProbeBackendSpec)
    source = f"{spec.gguf.package or PurePath(spec.gguf.path or '').name} n_ctx {spec.n_ctx}"
    return source if spec.reading == "hidden" else f"{source} {spec.reading}"


def candidate_costs(policy: Policy, vm: RoutedModel, input_tokens: float | np.ndarray) -> np.ndarray:
    prices = price_matrix(policy, vm)
    extra = np.array([c.reasoning_tokens if c.reasoning == "on" else 0 for c in vm.candidates], dtype=np.float64)
    base = expected_costs(prices, input_tokens, vm.output_tokens)
    costs: np.ndarray = base + extra * prices[:, 1] / 1e6  # numpy's stubs type a column's arithmetic Any
    return costs


def top_gap(quality: np.ndarray) -> np.ndarray:
    """Per row, how far apart the two best candidates' P(right) are (pruned ones, -inf, left out;
    inf where fewer than two remain: no choice to make): where it is small, the call is close."""
    q = np.sort(np.where(np.isfinite(quality), np.atleast_2d(quality), -np.inf), axis=1)[:, ::-1]
    if q.shape[1] < 2:
        return np.full(len(q), np.inf)
    with np.errstate(invalid="ignore"):  # -inf - -inf: no two left
        gap = q[:, 0] - q[:, 1]
    out: np.ndarray = np.where(np.isfinite(gap), gap, np.inf)
    return out


def _eligible(
    policy: Policy,
    vm: RoutedModel,
    quality: np.ndarray,
    input_tokens: float,
    accuracy: np.ndarray | None,
    barred: Sequence[int],
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The candidates the choice is among (not barred, unless every one is), their predictions
    with the dominated ones pruned, (1, kept), and their costs, (kept,)."""
    q = np.asarray(quality, dtype=np.float64).reshape(1, -1)
    cost = candidate_costs(policy, vm, input_tokens)
    keep = [j for j in range(len(vm.candidates)) if j not in set(barred)] or list(range(len(vm.candidates)))
    acc = accuracy[keep] if accuracy is not None and vm.prune_dominated else None
    return keep, prune(q[:, keep], cost[keep], acc), cost[keep]


def close_rows(quality: np.ndarray, margin: float) -> np.ndarray:
    """The probe's rule, per row of (pruned) predictions: the two best candidates' P(right) within
    ``margin`` (serving, training, eval and calibration all ask it here)."""
    out: np.ndarray = top_gap(quality) <= margin
    return out


def close_call(
    policy: Policy,
    vm: RoutedModel,
    quality: np.ndarray,
    input_tokens: float,
    accuracy: np.ndarray | None = None,
    barred: Sequence[int] = (),
) -> bool:
    """Whether the probe should read this request: the two best of the candidates the choice is
    among are within the probe's margin (arguments as :func:`choose_candidate`'s)."""
    assert vm.probe is not None
    _, q, _ = _eligible(policy, vm, quality, input_tokens, accuracy, barred)
    return bool(close_rows(q, vm.probe.margin)[0])


def choose_candidate(
    policy: Policy,
    vm: RoutedModel,
    quality: np.ndarray,
    input_tokens: float,
    accuracy: np.ndarray | None = None,
    barred: Sequence[int] = (),
) -> QualityChoice:
    """The candidate for one request: ``quality`` is the heads' P(right), one per candidate;
    ``accuracy``: each candidate's on the dev rows, to prune the dominated ones (:func:`prune`);
    ``barred``: candidates that cannot take the request, left out of the choice (unless every one is:
    then the choice is made among all, and the model chain says which can take it)."""
    q = np.asarray(quality, dtype=np.float64).reshape(1, -1)
    cost = candidate_costs(policy, vm, input_tokens)
    keep, pruned_q, kept_cost = _eligible(policy, vm, quality, input_tokens, accuracy, barred)
    k = int(choose(pruned_q, kept_cost, vm.rule, vm.knob)[0])
    i = keep[k]
    dearest = int(np.argmax(cost))
    c = vm.candidates[i]
    preds = tuple(
        (candidate_label(k.model, k.reasoning), float(q[0, j]), float(cost[j])) for j, k in enumerate(vm.candidates)
    )
    return QualityChoice(
        i, c.model, c.reasoning, float(q[0, i]), float(q.max()), float(q[0, dearest]), float(cost[i]), preds
    )
