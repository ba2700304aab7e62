"""The prefix scheduler's pure core: grouping and ordering properties on generated prompt sets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.prefix import Group, Item, approx_tokens, flatten, ideal_reuse, plan, reuse_in_order

# no example database on disk (nothing to clean up in the repo), no per-example deadline (no timed tests)
settings.register_profile("prefix", database=None, deadline=None, max_examples=200)
PROFILE = settings.get_profile("prefix")

# a small alphabet, so templates and suffixes collide and the tree has shared branches at every depth
TOKEN = st.integers(min_value=0, max_value=5)


@st.composite
def template_sets(draw: st.DrawFn) -> list[Item]:
    """Requests built as a shared template (a few-shot prefix) plus a random suffix, in random order."""
    templates = draw(st.lists(st.lists(TOKEN, max_size=40), min_size=1, max_size=5))
    n = draw(st.integers(min_value=0, max_value=40))
    items = []
    for key in range(n):
        t = draw(st.sampled_from(templates))
        suffix = draw(st.lists(TOKEN, max_size=10))
        items.append(Item(key, tuple(t + suffix), draw(st.integers(min_value=0, max_value=64))))
    return items


ORDER = st.sampled_from(["decode_ratio", "none"])
MIN_SHARED = st.integers(min_value=1, max_value=24)


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokens_in(groups: list[Group], items: list[Item]) -> Iterator[tuple[int, ...]]:
    by_key = {it.key: it.tokens for it in items}
    return (by_key[k] for k in flatten(groups))


@PROFILE
@given(template_sets(), MIN_SHARED, ORDER)
def test_plan_on_template_sets(items: list[Item], min_shared: int, order: str) -> None:
    """One generated batch, every property of a plan (one test: generating the sets is the cost)."""
    groups = plan(items, min_shared=min_shared, order=order)
    check_every_key_exactly_once(groups, items)
    check_groups_share_their_prefix(groups, items, min_shared)
    check_groups_are_maximal(groups, items, min_shared)
    check_grouped_order_reaches_the_ideal_reuse(groups, items)
    if order == "none":
        assert list(tokens_in(groups, items)) == sorted(it.tokens for it in items)  # token order


def check_every_key_exactly_once(groups: list[Group], items: list[Item]) -> None:
    assert sorted(flatten(groups)) == [it.key for it in items]
    assert all(g.keys for g in groups)


def check_groups_share_their_prefix(groups: list[Group], items: list[Item], min_shared: int) -> None:
    by_key = {it.key: it.tokens for it in items}
    for g in groups:
        members = [by_key[k] for k in g.keys]
        assert g.prefix == min(lcp(members[0], m) for m in members)  # what they share, no more, no less
        if len(members) > 1:
            assert g.prefix >= min_shared
        else:
            assert g.prefix == len(members[0])


def check_groups_are_maximal(groups: list[Group], items: list[Item], min_shared: int) -> None:
    """Requests in different groups share fewer than min_shared tokens: no two groups could merge."""
    by_key = {it.key: it.tokens for it in items}
    firsts = [by_key[g.keys[0]] for g in groups]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1 :]:
            assert lcp(a, b) < min_shared


def check_grouped_order_reaches_the_ideal_reuse(groups: list[Group], items: list[Item]) -> None:
    """The dispatch order is a depth-first walk of the tree: a one-slot cache reuses every shared
    token, whatever the ordering rule; so grouping never loses to arrival order."""
    prompts = [it.tokens for it in items]
    grouped = reuse_in_order(tokens_in(groups, items))
    assert grouped == pytest.approx(ideal_reuse(prompts), abs=1e-12)
    assert grouped >= reuse_in_order(prompts) - 1e-12
    assert grouped >= 0.9 * ideal_reuse(prompts)


def trie_nodes(prompts: Sequence[Sequence[int]]) -> int:
    return len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})


@PROFILE
@given(st.lists(st.lists(TOKEN, max_size=30), max_size=30))
def test_ideal_reuse_is_the_trie_count(prompts: list[list[int]]) -> None:
    total = sum(map(len, prompts))
    r = ideal_reuse(prompts)
    assert 0.0 <= r <= 1.0
    assert r == pytest.approx(1 - trie_nodes(prompts) / total if total else 0.0, abs=1e-12)


@PROFILE
@given(st.lists(st.lists(TOKEN, max_size=30), max_size=30))
def test_reuse_in_order_is_the_lcp_with_the_previous_prompt(prompts: list[list[int]]) -> None:
    total = sum(map(len, prompts))
    shared = sum(lcp(a, b) for a, b in zip([[], *prompts], prompts, strict=False))
    r = reuse_in_order(prompts)
    assert r == pytest.approx(shared / total if total else 0.0, abs=1e-12)
    assert r <= ideal_reuse(prompts) + 1e-12  # no order beats the tree


def test_decode_ratio_puts_decode_heavy_subtrees_first() -> None:
    short_answers = [Item(k, (1,) * 20 + (k,), decode=1) for k in range(3)]
    long_answers = [Item(10 + k, (2,) * 20 + (k,), decode=200) for k in range(3)]
    mixed = [Item(20, (3,) * 20 + (0, 0), decode=1), Item(21, (3,) * 20 + (1, 1), decode=50)]
    items = short_answers + long_answers + mixed
    groups = plan(items, min_shared=16, order="decode_ratio")
    assert [g.keys for g in groups] == [(10, 11, 12), (21, 20), (0, 1, 2)]
    assert [g.prefix for g in groups] == [20, 20, 20]
    none = plan(items, min_shared=16)  # the default: token order
    assert [g.keys for g in none] == [(0, 1, 2), (10, 11, 12), (20, 21)]


def test_requests_sharing_little_are_groups_of_one() -> None:
    items = [Item(0, (1, 2, 3)), Item(1, (1, 2, 4)), Item(2, ()), Item(3, (9,) * 30), Item(4, (9,) * 30)]
    groups = plan(items, min_shared=3, order="none")
    assert groups == [Group(0, (2,)), Group(3, (0,)), Group(3, (1,)), Group(30, (3, 4))]
    assert plan([], min_shared=3) == []


@pytest.mark.parametrize(
    ("kwargs", "items"),
    [
        ({"order": "fifo"}, [Item(0, (1,))]),
        ({"min_shared": 0}, [Item(0, (1,))]),
        ({}, [Item(0, (1,)), Item(0, (2,))]),
        ({}, [Item(0, (-1,))]),
        ({}, [Item(0, (2**32,))]),
    ],
)
def test_bad_input(kwargs: dict[str, object], items: list[Item]) -> None:
    with pytest.raises(ValueError):
        plan(items, **kwargs)  # type: ignore[arg-type]


TEXT = st.text(alphabet=st.sampled_from("ab \n:.é"), max_size=40)


@PROFILE
@given(TEXT, TEXT, TEXT)
def test_approx_tokens_keep_shared_text_prefixes(p: str, x: str, y: str) -> None:
    a, b = approx_tokens(p + x), approx_tokens(p + y)
    assert approx_tokens(p + x) == a  # deterministic
    pieces = len(approx_tokens(p)) if p else 0
    assert lcp(a, b) >= pieces - 1  # every piece of the prefix but the one its end may cut
    if x == y:
        assert a == b


@PROFILE
@given(TEXT, TEXT)
def test_approx_tokens_tell_texts_apart(a: str, b: str) -> None:
    """Lossless splitting: different texts give different pieces (a CRC collision aside)."""
    assert (approx_tokens(a) == approx_tokens(b)) == (a == b)


def test_approx_tokens_are_stable() -> None:
    """CRC-32 of the pieces: the same ids in every process (unlike hash(), which is salted)."""
    assert approx_tokens("Q: yes\nA: no") == (611690328, 1978086825, 3719887666, 1739204639)
    assert approx_tokens("") == ()


@pytest.mark.model
def test_the_scorer_reuses_what_the_plan_predicts() -> None:
    """The local scorer keeps one prompt; in plan order it evaluates only the unshared tokens (all
    but the last token of a prompt cached whole, which it evaluates again for its logits)."""
    from backends.gguf import smollm2_path
    from backends.logprob import OptionScorer

    scorer = OptionScorer(smollm2_path(), n_ctx=256, n_threads=1, n_batch=64)
    try:
        template = "Answer yes or no.\nQ: Is the sky blue?\nA: yes\nQ: Is fire cold?\nA: no\nQ: "
        prompts = ["Is ice cold?\nA:", "Is snow hot?\nA:", "Name a colour.\nA:", "Is ice cold?\nA:"]
        texts = [template + q if i < 3 else q for i, q in enumerate(prompts)]
        tokens = [tuple(scorer.tokenize(t, bos=True)) for t in texts]
        order = flatten(plan([Item(i, t, 1) for i, t in enumerate(tokens)], min_shared=8))
        reused = [scorer.score(texts[k], [" yes", " no"]).reused_tokens for k in order]
    finally:
        scorer.close()
    in_order = [tokens[k] for k in order]
    expected = [0] + [min(lcp(a, b), len(b) - 1) for a, b in pairwise(in_order)]
    assert reused == expected
    assert sum(reused) > 0
