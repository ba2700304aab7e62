"""Prefix-sorted dispatch, the pure core: a prefix tree over a batch, cut into groups, ordered.

A batch of prompts (token ids) goes into a prefix tree. The tree is built from the prompts in
sorted order: the longest common prefix (LCP) of neighbours in that order gives every branching
point, so one sort and n-1 LCPs build it (no per-token nodes). The tree is then walked depth
first and cut into groups: the subtrees whose root is at least ``min_shared`` tokens deep. Every
member of a group shares the group's ``prefix``; a request that shares fewer tokens with every
other is a group of its own.

Order. ``order="none"`` (the default) visits the subtrees at every branching point in token
order; ``order="decode_ratio"`` in decreasing ratio of decode work to the prompt work they add
(BatchLLM's rule, applied at each level: requests with more decode relative to their prompt
first; it gained nothing measured on llama.cpp or vLLM's CPU build, docs/benchmarks.md). Either way the
dispatch order is a depth-first walk of the tree, so an engine that keeps only the previous
prompt (llama.cpp's slot, the local scorer's sequence 0) reuses every shared token: the reuse of
the order equals :func:`ideal_reuse`.

Tokens are ints in [0, 2**32). With no tokenizer for the target model, :func:`approx_tokens`
stands in. No I/O, no asyncio: the dispatcher calls :func:`plan` and sends what it returns.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

ORDERS = ("decode_ratio", "none")

# big-endian 4-byte token ids: byte order of the keys is the tokens' lexicographic order, and a
# shared token prefix of k tokens is a shared byte prefix of 4k bytes
_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_WIDTH = 4


@dataclass(frozen=True)
class Item:
    key: int  # the caller's index of the request
    tokens: tuple[int, ...]  # prompt tokens (from the model's tokenizer, or approx_tokens)
    decode: int = 16  # expected decode tokens (max_tokens, or an estimate)


@dataclass(frozen=True)
class Group:
    prefix: int  # tokens every member shares (a group of one: all its tokens)
    keys: tuple[int, ...]  # members, in dispatch order


def approx_tokens(text: str) -> tuple[int, ...]:
    """Tokens for a model whose tokenizer is unknown: the CRC-32 of each piece of the UTF-8 text
    split at spaces, a newline starting a piece of its own. Lossless (the pieces give the text
    back), stable across processes and machines, and cheap (about 0.05 ms for a 1.4k-character
    prompt, where SmolLM2's own tokenizer takes 1.5 ms); about 0.56 pieces per SmolLM2 token on
    BBH prompts. Equal texts give equal tokens; two texts sharing a prefix share every piece of it
    but the last (the piece the end of the prefix may cut). A CRC collision can only make two
    prompts look more alike than they are. The empty text has no tokens."""
    if not text:
        return ()
    return tuple(map(zlib.crc32, text.encode("utf-8", "surrogatepass").replace(b"\n", b" \n").split(b" ")))


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a request's prompt is made of, in order, for grouping and affinity: the messages'
    contents, a completion's prompt, or a typed question's passage and question."""
    if isinstance(body.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    if "question" in body:  # /v1/decide: the passage first, as the scorer sees it
        return f"{body.get('context') or ''}\n{body.get('question', '')}"
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else str(prompt)


def plan(items: Sequence[Item], *, min_shared: int = 16, order: str = "none") -> list[Group]:
    """Groups of requests sharing at least ``min_shared`` prompt tokens, in dispatch order.

    Every key appears exactly once; a multi-member group's ``prefix`` is at least ``min_shared``.
    ``order``: ``"none"`` (token order, the default) or ``"decode_ratio"`` (BatchLLM's rule at every
    branching point)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
    if min_shared < 1:
        raise ValueError(f"min_shared must be at least 1, not {min_shared}")
    if len({it.key for it in items}) != len(items):
        raise ValueError("duplicate keys in the batch")
    if not items:
        return []
    keys = [_key(it.tokens) for it in items]
    root = _tree(keys)
    if order == "decode_ratio":
        _order_by_ratio(root, items)
    return _cut(root, items, min_shared)


def ideal_reuse(token_lists: Sequence[Sequence[int]]) -> float:
    """1 - (unique tokens of the prefix tree over all prompts) / (total prompt tokens)."""
    total = sum(len(t) for t in token_lists)
    if total == 0:
        return 0.0
    keys = sorted(_key(t) for t in token_lists)
    return sum(_lcp(a, b) for a, b in pairwise(keys)) / total


def reuse_in_order(token_lists_in_order: Iterable[Sequence[int]]) -> float:
    """The reuse of an engine whose cache holds only the previous prompt (llama.cpp's slot): the sum
    of each prompt's LCP with the one before it, over the total prompt tokens. (llama.cpp evaluates
    the last token of a prompt cached whole once more for its logits; that token is counted as
    reused here, as :func:`ideal_reuse` counts a repeated prompt as shared.)"""
    total = shared = 0
    prev = b""
    for tokens in token_lists_in_order:
        k = _key(tokens)
        total += len(tokens)
        shared += _lcp(prev, k)
        prev = k
    return shared / total if total else 0.0


def flatten(groups: Iterable[Group]) -> list[int]:
    """The keys in dispatch order."""
    return [k for g in groups for k in g.keys]


def sort_key(tokens: Sequence[int]) -> bytes:
    """Tokens as bytes whose order is the tokens' order and whose shared prefix is theirs."""
    return _key(tokens)


def shared_tokens(a: bytes, b: bytes) -> int:
    """Tokens two :func:`sort_key` keys share at the start."""
    return _lcp(a, b)


# -- the tree ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Node:
    depth: int  # tokens shared by every leaf below (the LCP of the subtree)
    kids: list[_Node | int] = field(default_factory=list)  # nodes, or leaves: indices into items
    decode: int = 0  # decode tokens of the leaves below (set by _order_by_ratio)
    work: int = 0  # unique prompt tokens below this depth (set by _order_by_ratio)


def _key(tokens: Sequence[int]) -> bytes:
    try:
        a = array(_TYPECODE, tokens)
    except OverflowError:
        raise ValueError("token ids must be ints in [0, 2**32)") from None
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def common_prefix_len(a: str | bytes, b: str | bytes) -> int:
    """Characters (or bytes) two strings share at the start: bisect on slices (each comparison a memcmp)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _lcp(a: bytes, b: bytes) -> int:
    """Tokens two keys share at the start."""
    return common_prefix_len(a, b) // _WIDTH


def _tree(keys: list[bytes]) -> _Node:
    """The compacted prefix tree: sorted leaves, a node wherever neighbours branch."""
    sorted_ix = sorted(range(len(keys)), key=keys.__getitem__)
    root = _Node(0, [sorted_ix[0]])
    stack = [root]
    for prev, i in pairwise(sorted_ix):
        shared = _lcp(keys[prev], keys[i])
        while stack[-1].depth > shared:
            stack.pop()
        top = stack[-1]
        if top.depth < shared:  # the previous leaf's subtree and this leaf branch below top
            node = _Node(shared, [top.kids.pop()])
            top.kids.append(node)
            stack.append(node)
        stack[-1].kids.append(i)
    return root


def _preorder(root: _Node) -> list[_Node]:
    out, todo = [], [root]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(k for k in node.kids if isinstance(k, _Node))
    return out


def _order_by_ratio(root: _Node, items: Sequence[Item]) -> None:
    """Sort every node's subtrees by decode work over the prompt tokens they add, largest first
    (stable: ties keep token order)."""
    for node in reversed(_preorder(root)):  # children before parents
        weights: list[tuple[float, int]] = []
        d_sum = w_sum = 0
        for kid in node.kids:
            if isinstance(kid, _Node):
                d, w = kid.decode, kid.depth - node.depth + kid.work
            else:
                d, w = items[kid].decode, len(items[kid].tokens) - node.depth
            d_sum += d
            w_sum += w
            weights.append((d / max(w, 1), len(weights)))
        node.decode, node.work = d_sum, w_sum
        if len(node.kids) > 1:
            weights.sort(key=lambda r: -r[0])
            node.kids = [node.kids[j] for _, j in weights]


def _cut(root: _Node, items: Sequence[Item], min_shared: int) -> list[Group]:
    """Depth-first: each subtree rooted at least ``min_shared`` deep is a group; a leaf above that
    depth is a group of one. (The root is at depth 0, below any ``min_shared``.)"""
    groups: list[Group] = []
    todo: list[_Node | int] = list(reversed(root.kids))
    while todo:
        kid = todo.pop()
        if not isinstance(kid, _Node):
            groups.append(Group(len(items[kid].tokens), (items[kid].key,)))
        elif kid.depth >= min_shared:
            groups.append(Group(kid.depth, tuple(items[i].key for i in _leaves(kid))))
        else:
            todo.extend(reversed(kid.kids))
    return groups


def _leaves(node: _Node) -> list[int]:
    out: list[int] = []
    todo: list[_Node | int] = [node]
    while todo:
        kid = todo.pop()
        if isinstance(kid, _Node):
            todo.extend(reversed(kid.kids))
        else:
            out.append(kid)
    return out
