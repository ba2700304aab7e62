"""Cascade routing over a pool (issue 56): the next model to ask, given the votes so far
(:mod:`policies.pool`). Pure (numpy only), batched over rows (one row is a request).

Cascade routing (arXiv 2410.10347): asking model ``m`` is worth the expected calibrated confidence
after its answer (its answer predicted from the posterior and its prior: right with ``p``, wrong onto
an option already named ``(k - 1) / spread`` times as often as onto another) less ``knob * cost``
(``knob``: quality per unit of money, the learned router's ``utility`` rule); stopping is worth the
confidence now. One step ahead is not enough: a second cheap answer alone rarely overturns the
first, its worth is that agreement may spare the dear model after it. So :func:`lookahead` looks
three steps ahead: after ``m``, stop or ask one of the ``shortlist`` most trusted models left that
no other left beats on both prior and cost, then stop or ask the most trusted left. The candidates
at each step are the models not asked that no other not asked beats on both P(right) and cost. The
decision (:func:`step`; :func:`replay` drives it over recorded answers) stops when no model is worth
more than stopping, and answers the posterior's top option. At least one model is asked
(``min_calls``).
"""

from __future__ import annotations

import numpy as np

from policies.pool import (
    EPS,
    NO_ANSWER,
    Agreement,
    base_weight,
    calibrated,
    decide,
    named,
    per_row,
    vote_weight,
    votes,
    wrong_options,
)


def compress(z: np.ndarray, said: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The options of equal votes grouped (those no answer named, mostly): (each group's votes, -inf
    past the last group; how many options it holds; whether they are unnamed, ``said`` being the
    named options, default all), each ``(rows, groups)``."""
    rows = z.shape[0]
    unnamed_opt = np.zeros(z.shape, dtype=bool) if said is None else ~said
    order = np.lexsort((unnamed_opt, -z), axis=1)
    s = np.take_along_axis(z, order, axis=1)
    u = np.take_along_axis(unnamed_opt, order, axis=1)
    live = np.isfinite(s)
    start = live.copy()
    start[:, 1:] &= (s[:, 1:] != s[:, :-1]) | (u[:, 1:] != u[:, :-1])
    group = np.cumsum(start, axis=1) - 1
    width = int(start.sum(axis=1).max())
    v = np.full((rows, width), -np.inf)
    mult = np.zeros((rows, width))
    unnamed = np.zeros((rows, width), dtype=bool)
    r, c = np.nonzero(live)
    np.add.at(mult, (r, group[r, c]), 1.0)
    v[r, group[r, c]] = s[r, c]
    unnamed[r, group[r, c]] = u[r, c]
    return v, mult, unnamed


def _predictive(post: np.ndarray, mult: np.ndarray, unnamed: np.ndarray, p: np.ndarray, ag: Agreement) -> np.ndarray:
    """(states, models, groups): how likely each model (right with ``p`` (states, models)) names an
    option of each group. Given the truth, it names it with ``p``; a wrong answer lands on an option
    already named ``(k - 1) / spread`` times as often as on one not named yet (errors gather: the
    same collision rate the votes assume; uniform with ``spread`` 0)."""
    k = mult.sum(axis=1)
    gather = (k - 1.0) / wrong_options(k, ag.spread)
    weight = np.where(unnamed, 1.0, gather[:, None]) * (mult > 0)  # (states, groups): one option's pull
    total = (mult * weight).sum(axis=1)
    pm = np.clip(p, 1.0 / k[:, None], 1.0 - EPS)[:, :, None]
    # each truth group's mass of wrong answers, per option of pull 1 (the truth itself left out)
    spill = post[:, None, :] * mult[:, None, :] * (1.0 - pm) / (total[:, None] - weight)[:, None, :]
    q: np.ndarray = pm * post[:, None, :] * mult[:, None, :] + weight[:, None, :] * (
        mult[:, None, :] * spill.sum(axis=2, keepdims=True) - spill
    )
    return q


def _grouped_gain(
    v: np.ndarray,
    mult: np.ndarray,
    unnamed: np.ndarray,
    base: np.ndarray,
    w: np.ndarray,
    p: np.ndarray,
    ag: Agreement,
) -> np.ndarray:
    """(states, models): the expected calibrated confidence after each model's answer, on grouped
    states (:func:`compress`; ``base`` (states,): an unnamed option's votes, which a name replaces)."""
    shift = np.max(np.where(mult > 0, v, -np.inf), axis=1, keepdims=True)
    e = np.where(mult > 0, np.exp(v - shift), 0.0)  # (states, groups)
    total = (mult * e).sum(axis=1)
    post = e / total[:, None]
    # the best option other than the one named in group i: the best other group, or i's own if it holds more
    order = np.sort(e, axis=1)
    top1 = order[:, -1]
    top2 = order[:, -2] if e.shape[1] > 1 else np.zeros(len(e))
    best = e.argmax(axis=1)
    other = np.where(np.arange(e.shape[1])[None, :] == best[:, None], top2[:, None], top1[:, None])
    other = np.where(mult > 1, np.maximum(other, e), other)
    delta = w[:, :, None] - np.where(unnamed, base[:, None], 0.0)[:, None, :]  # (states, models, groups)
    lift = np.exp(delta)
    ej = e[:, None, :]
    new_top = np.maximum(other[:, None, :], ej * lift) / (total[:, None, None] + ej * (lift - 1.0))
    q = _predictive(post, mult, unnamed, p, ag)
    after: np.ndarray = (q * calibrated(np.where(mult[:, None, :] > 0, new_top, 0.5), ag)).sum(axis=2) / q.sum(axis=2)
    return after


def _top(v: np.ndarray, mult: np.ndarray) -> np.ndarray:
    shift = np.max(np.where(mult > 0, v, -np.inf), axis=1, keepdims=True)
    e = np.where(mult > 0, np.exp(v - shift), 0.0)
    top: np.ndarray = e.max(axis=1) / (mult * e).sum(axis=1)
    return top


def expected_gain(
    z: np.ndarray,
    weights: np.ndarray,
    p: np.ndarray,
    ag: Agreement,
    said: np.ndarray | None = None,
    base: np.ndarray | None = None,
) -> np.ndarray:
    """(rows, models): the expected calibrated confidence after asking each model, less the present
    one (``z``: :func:`votes`, its options beyond ``k`` at -inf; ``said``: the named options;
    ``base``: an unnamed option's votes, default 0)."""
    v, mult, unnamed = compress(z, said)
    base = np.zeros(len(z)) if base is None else base
    now = calibrated(_top(v, mult), ag)
    gain: np.ndarray = (
        _grouped_gain(v, mult, unnamed, base, np.atleast_2d(weights), np.atleast_2d(p), ag) - now[:, None]
    )
    return gain


def _children(
    v: np.ndarray, mult: np.ndarray, unnamed: np.ndarray, base: np.ndarray, w: np.ndarray, p: np.ndarray, ag: Agreement
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every answer of every candidate (``w`` (states, candidates)) to grouped states (states,
    groups): the states after it, flattened (states * candidates * groups, groups + 1) as values,
    counts and unnamed flags; and how likely each is (states, candidates, groups)."""
    n, groups = v.shape
    c = w.shape[1]
    shift = np.max(np.where(mult > 0, v, -np.inf), axis=1, keepdims=True)
    e = np.where(mult > 0, np.exp(v - shift), 0.0)
    post = e / (mult * e).sum(axis=1, keepdims=True)
    delta = w[:, :, None] - np.where(unnamed, base[:, None], 0.0)[:, None, :]  # (states, candidates, groups)
    shape = (n, c, groups, groups)
    v2 = np.concatenate([np.broadcast_to(v[:, None, None, :], shape), (v[:, None, :] + delta)[..., None]], axis=3)
    m2 = np.concatenate(
        [np.broadcast_to(mult[:, None, None, :] - np.eye(groups), shape), np.ones((n, c, groups, 1))], axis=3
    )
    u2 = np.concatenate(
        [np.broadcast_to(unnamed[:, None, None, :], shape), np.zeros((n, c, groups, 1), dtype=bool)], axis=3
    )
    width = groups + 1
    q = _predictive(post, mult, unnamed, p, ag)
    return v2.reshape(-1, width), m2.reshape(-1, width), u2.reshape(-1, width), q, post


def _mean(q: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The expectation over the last axis; a candidate with no chance anywhere is worth -inf."""
    total = q.sum(axis=-1)
    out = (q * np.where(q > 0, value, 0.0)).sum(axis=-1) / np.where(total > 0, total, 1.0)
    return np.where(total > 0, out, -np.inf)


def front(p: np.ndarray, cost: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(rows, models): the allowed models no other allowed one beats on both P(right) and cost."""
    better = (p[:, :, None] >= p[:, None, :]) & (cost[:, :, None] <= cost[:, None, :])
    strict = (p[:, :, None] > p[:, None, :]) | (cost[:, :, None] < cost[:, None, :])
    beats = better & strict & allowed[:, :, None]  # [row, i, j]: i beats j
    out: np.ndarray = allowed & ~beats.any(axis=1)
    return out


def _pick(rank: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` best by ``rank`` where ``mask`` (last axis), -1 past those there are."""
    order = np.argsort(np.where(mask, -rank, np.inf), axis=-1, kind="stable")[..., :n]
    return np.where(np.take_along_axis(mask, order, axis=-1), order, -1)


def _take(x: np.ndarray, ids: np.ndarray, fill: float) -> np.ndarray:
    """``x`` (rows, models) at ``ids`` (rows, ...), ``fill`` where an id is -1."""
    flat = ids.reshape(len(ids), -1)
    got = np.take_along_axis(x, np.maximum(flat, 0), axis=1)
    return np.where(flat >= 0, got, fill).reshape(ids.shape)


def lookahead(
    z: np.ndarray,
    p: np.ndarray,
    w: np.ndarray,
    cost: np.ndarray,
    asked: np.ndarray,
    ag: Agreement,
    knob: float,
    said: np.ndarray | None = None,
    base: np.ndarray | None = None,
    shortlist: int = 3,
) -> np.ndarray:
    """(rows, models): the worth of asking each model now, three steps ahead, less ``knob`` times its
    cost; -inf for a model not considered (asked, a NaN prior, no vote, or beaten on both P(right)
    and cost by another not asked). After model ``m``: stop, or ask one of the ``shortlist`` most
    trusted of those left that no other left beats; after that: stop, or ask the most trusted left."""
    rows, models = w.shape
    base = np.zeros(rows) if base is None else base
    cost = np.broadcast_to(np.asarray(cost, dtype=np.float64), (rows, models))
    trust = np.nan_to_num(p, nan=-1.0)
    allowed = ~asked & ~np.isnan(p) & (w > 0)
    first = front(trust, cost, allowed)
    roots = _pick(-cost, first, models)  # every model on the front, cheapest first
    roots = roots[:, : max(1, int((roots >= 0).sum(axis=1).max()))]
    r1 = roots.shape[1]
    # the second step's candidates after each root: the front of those left
    left = allowed[:, None, :] & (np.arange(models)[None, None, :] != roots[:, :, None])
    second = np.stack([front(trust, cost, left[:, i]) for i in range(r1)], axis=1)
    seconds = _pick(np.broadcast_to(trust[:, None, :], second.shape), second, shortlist)  # (rows, r1, T)
    # the third: the most trusted left after the root and the second
    top = _pick(trust, allowed, 3)  # (rows, 3)
    used = (top[:, None, None, :] == roots[:, :, None, None]) | (top[:, None, None, :] == seconds[..., None])
    thirds = np.where(used, -1, top[:, None, None, :])
    third = np.take_along_axis(thirds, np.argmax(thirds >= 0, axis=3)[..., None], axis=3)[..., 0]  # (rows, r1, T)

    v, mult, unnamed = compress(z, said)
    g = v.shape[1]
    v1, m1, u1, q1, _ = _children(
        v, mult, unnamed, base, _take(w, roots, 0.0), _take(trust, roots, 0.0), ag
    )  # (rows * r1 * g, g + 1)
    b1 = np.repeat(base, r1 * g)
    w2 = np.repeat(_take(w, seconds, 0.0).reshape(rows * r1, -1), g, axis=0)  # (rows * r1 * g, T)
    p2 = np.repeat(_take(trust, seconds, 0.0).reshape(rows * r1, -1), g, axis=0)
    v2, m2, u2, q2, _ = _children(v1, m1, u1, b1, w2, p2, ag)  # (rows * r1 * g * T * (g + 1), g + 2)
    t = seconds.shape[2]
    b2 = np.repeat(b1, t * (g + 1))

    def per_state(x: np.ndarray) -> np.ndarray:  # (rows, r1, T) -> one per state after the second answer
        return np.broadcast_to(x[:, :, None, :, None], (rows, r1, g, t, g + 1)).reshape(-1)

    w3, p3 = per_state(_take(w, third, 0.0))[:, None], per_state(_take(trust, third, 0.0))[:, None]
    gain3 = _grouped_gain(v2, m2, u2, b2, w3, p3, ag)[:, 0]
    c3 = per_state(_take(cost, third, 0.0))
    ok3 = per_state(third >= 0)
    conf2 = calibrated(_top(v2, m2), ag)
    value2 = np.maximum(conf2, np.where(ok3, gain3 - knob * c3, -np.inf)).reshape(-1, t, g + 1)
    c2 = np.repeat(_take(cost, seconds, 0.0).reshape(rows * r1, t), g, axis=0)
    act2 = np.where(np.repeat(seconds.reshape(rows * r1, t), g, axis=0) >= 0, _mean(q2, value2) - knob * c2, -np.inf)
    value1 = np.maximum(calibrated(_top(v1, m1), ag), act2.max(axis=1)).reshape(rows, r1, g)
    act1 = _mean(q1, value1) - knob * _take(cost, roots, 0.0)
    out = np.full((rows, models), -np.inf)
    r, i = np.nonzero(roots >= 0)
    out[r, roots[r, i]] = act1[r, i]
    return out


def next_model(value: np.ndarray, now: np.ndarray, must: np.ndarray | None = None) -> np.ndarray:
    """Per row, the model worth most (``value``, -inf where not allowed) if it is worth more than
    stopping (``now``, the confidence now), or -1. ``must``: rows that ask one whatever it is worth."""
    best = value.max(axis=1)
    go = best > now + 1e-12
    if must is not None:
        go = go | must
    return np.where(go & np.isfinite(best), value.argmax(axis=1), -1)


def _state(
    asked: np.ndarray, answers: np.ndarray, w: np.ndarray, base: np.ndarray, k: np.ndarray, width: int, combine: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The votes that count, the options named, and (without ``combine``) each row's weight in
    force: every answer given (agreement), or only the answer of the most trusted model asked (a
    plain cascade)."""
    given = np.where(asked & (answers >= 0), answers, NO_ANSWER)
    if combine:
        return votes(given, w, k, width, base), named(given, width), np.zeros(len(k))
    wi = np.where(given >= 0, w, -np.inf)
    lead = wi.argmax(axis=1)
    has = (given >= 0).any(axis=1)
    only = np.full(answers.shape, NO_ANSWER)
    rows = np.flatnonzero(has)
    only[rows, lead[rows]] = given[rows, lead[rows]]
    return votes(only, w, k, width, base), named(only, width), np.where(has, wi.max(axis=1), -np.inf)


def _single(weight: np.ndarray, base: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The posterior's top probability after one vote of ``weight`` among ``k`` options."""
    top: np.ndarray = 1.0 / (1.0 + (k - 1.0) * np.exp(base - weight))
    return top


def step(
    asked: np.ndarray,
    answers: np.ndarray,
    p: np.ndarray,
    cost: np.ndarray,
    k: np.ndarray | int,
    ag: Agreement,
    knob: float,
    combine: bool = True,
    width: int | None = None,
    min_calls: int = 1,
    shortlist: int = 3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decision for every row: (the model to ask next or -1, the answer now, its confidence).
    ``asked`` (rows, models): asked already; ``answers``: their option indices (``NO_ANSWER``: none
    given); ``p``: the models' priors; ``cost``: a call's cost (models,) or (rows, models); a model
    with a NaN prior is never asked. ``combine=False``: a plain cascade, where only the most trusted
    answer so far counts (the ablation of agreement: an answer then says nothing of its own
    correctness beyond its prior, so one step ahead is exact)."""
    asked = np.atleast_2d(asked)
    rows = asked.shape[0]
    kk = per_row(k, rows)
    width = int(kk.max()) if width is None else width
    p = np.atleast_2d(np.asarray(p, dtype=np.float64))
    cost = np.broadcast_to(np.asarray(cost, dtype=np.float64), asked.shape)
    w = vote_weight(np.nan_to_num(p, nan=0.0), kk, ag.temper, ag.spread)
    base = base_weight(kk, rows, ag.temper, ag.spread)
    z, said, lead = _state(asked, np.atleast_2d(answers), w, base, kk, width, combine)
    answer, confidence = decide(z, ag)
    if combine:
        value = lookahead(z, p, w, cost, asked, ag, knob, said, base, shortlist)
    else:  # a model's answer replaces the answer in force where it is trusted more
        now = np.where(np.isfinite(lead), calibrated(_single(lead, base, kk), ag), calibrated(1.0 / kk, ag))
        value = np.maximum(calibrated(_single(w, base[:, None], kk[:, None]), ag), now[:, None]) - knob * cost
        value = np.where(asked | np.isnan(p), -np.inf, value)
    must = asked.sum(axis=1) < min_calls
    return next_model(value, confidence, must), answer, confidence


def replay(
    recorded: np.ndarray,
    p: np.ndarray,
    cost: np.ndarray,
    k: np.ndarray | int,
    ag: Agreement,
    knob: float,
    combine: bool = True,
    max_calls: int | None = None,
    chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decision driven to its end over recorded answers (rows, models) (offline; the gateway
    drives :func:`step` against live models), ``chunk`` rows at a time: (when each model was asked
    (rows, models): 0 first, -1 never; the answer; its confidence)."""
    recorded = np.atleast_2d(recorded)
    rows, models = recorded.shape
    kk = per_row(k, rows)
    width = int(kk.max())
    asked = np.zeros((rows, models), dtype=bool)
    asked_at = np.full((rows, models), -1, dtype=np.int64)
    answer = np.zeros(rows, dtype=np.int64)
    confidence = np.zeros(rows)
    live = np.ones(rows, dtype=bool)
    cost = np.broadcast_to(np.asarray(cost, dtype=np.float64), (rows, models))
    p = np.broadcast_to(np.atleast_2d(np.asarray(p, dtype=np.float64)), (rows, models))
    for turn in range((models if max_calls is None else max_calls) + 1):
        live_idx = np.flatnonzero(live)
        if not live_idx.size:
            break
        for idx in np.array_split(live_idx, max(1, -(-live_idx.size // chunk))):
            nxt, answer[idx], confidence[idx] = step(
                asked[idx], recorded[idx], p[idx], cost[idx], kk[idx], ag, knob, combine, width
            )
            if max_calls is not None:
                nxt = np.where(asked[idx].sum(axis=1) >= max_calls, -1, nxt)
            go = nxt >= 0
            asked[idx[go], nxt[go]] = True
            asked_at[idx[go], nxt[go]] = turn
            live[idx[~go]] = False
    return asked_at, answer, confidence
