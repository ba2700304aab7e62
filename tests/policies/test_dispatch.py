"""The dispatch rule, the pure core (policies/dispatch.py): blocks, the prefix index, the bound on
load, the cache, ties, background work."""

from __future__ import annotations

from policies.dispatch import (
    PrefixIndex,
    Seen,
    View,
    block_hashes,
    choose,
    covered,
    eligible,
    index_hashes,
    key_of,
    rank,
)

SYSTEM = "You are a careful assistant for the billing team. " * 40  # about 2 KB: 32 blocks of 64 bytes


def test_blocks_are_chained_over_the_whole_prefix() -> None:
    a = block_hashes(SYSTEM + "first user", 64)
    b = block_hashes(SYSTEM + "second user, longer", 64)
    shared = len(SYSTEM.encode()) // 64
    assert a[:shared] == b[:shared]
    assert block_hashes("x" * 63, 64) == ()
    # the same bytes at another depth are another block: a block's hash covers everything before it
    assert block_hashes("ab" * 64, 64)[1] != block_hashes("ab" * 32, 64)[0]
    assert len(block_hashes("y" * 64 * 1000, 64)) == 512  # bounded work for a huge prompt


def test_index_match_is_the_longest_run_from_the_first_block() -> None:
    idx = PrefixIndex([100, 100, 100])
    p = block_hashes(SYSTEM, 64)
    idx.add(0, p[:10])
    idx.add(1, p)
    assert idx.match(p, 0b111) == (len(p), 0b010)
    assert idx.match(p, 0b101) == (10, 0b001)  # replica 1 is not among the candidates
    other_start = block_hashes("Z" + SYSTEM[1:], 64)  # every later block differs too: the chain
    assert idx.match(other_start, 0b111) == (0, 0)
    idx.remove(1, p[5:6])
    assert idx.match(p, 0b010) == (5, 0b010)
    idx.clear(1)
    assert idx.match(p, 0b010) == (0, 0) and idx.held(1) == 0


def test_index_evicts_least_recently_used_deepest_first() -> None:
    idx = PrefixIndex([8])
    p = block_hashes(SYSTEM, 64)[:6]
    q = block_hashes("other prompt " * 40, 64)[:4]
    idx.add(0, p)
    idx.add(0, q)  # 10 blocks in 8: two of p's go, its deepest
    assert idx.held(0) == 8
    assert idx.match(p, 1) == (4, 1)
    assert idx.match(q, 1) == (4, 1)
    idx.resize(0, 2)
    assert idx.held(0) == 2 and len(idx) == 2


def test_the_replica_holding_the_prefix_takes_it_within_the_bound() -> None:
    idx = PrefixIndex([1000] * 4)
    p = block_hashes(SYSTEM + "q1", 64)
    idx.add(2, p)
    loads = [Seen(load=0), Seen(load=0), Seen(load=1), Seen(load=0)]
    assert choose(loads, index=idx, hashes=p) == (2, len(p))
    # past the bound (slack 2 above the least loaded, and over 1.5x the mean) it goes elsewhere
    hot = [Seen(load=0), Seen(load=1), Seen(load=3), Seen(load=0)]
    got = choose(hot, index=idx, hashes=p, slack=2, balance=1.5)
    assert got is not None and got[0] != 2 and got[1] == 0  # any replica within the bound, not the holder


def test_without_a_match_the_least_loaded_and_ties_by_the_key() -> None:
    loads = [Seen(load=2), Seen(load=1), Seen(load=1), Seen(load=5)]
    got = {choose(loads, strategy="least_load", key=key_of(f"k{i}"))[0] for i in range(40)}  # type: ignore[index]
    assert got == {1, 2}  # ties spread by the key, never to a more loaded replica
    k = key_of("session-7")
    assert choose(loads, key=k) == choose(list(loads), key=k)  # the same in any process
    assert rank(k, 1) != rank(k, 2)


def test_down_full_and_background() -> None:
    loads = [Seen(up=False), Seen(load=0, full=True), Seen(load=3)]
    assert choose(loads) == (2, 0)  # the full cache is skipped while another can take it
    assert choose([Seen(up=False)]) is None
    assert choose([Seen(load=1, full=True)]) == (0, 0)  # every cache full: the least loaded still
    busy = [Seen(load=6, spare=False), Seen(load=5, spare=False)]
    assert choose(busy, background=True) is None  # online first: a batch line waits
    assert choose(busy) is not None
    assert choose([Seen(load=6, spare=False), Seen(load=9, spare=True)], background=True) == (1, 0)


def test_the_bound_keeps_a_hot_prefix_from_piling_onto_one_replica() -> None:
    n, idx = 8, PrefixIndex([10_000] * 8)
    load = [0.0] * n
    p = block_hashes(SYSTEM, 64)
    for _ in range(200):  # one hot prefix, nothing finishes
        got = choose([Seen(load=x) for x in load], index=idx, hashes=p, balance=1.25, slack=2)
        assert got is not None
        load[got[0]] += 1
        idx.add(got[0], p)
    assert max(load) <= 1.25 * sum(load) / n + 1
    assert eligible([Seen(load=x) for x in (0, 10, 10)], balance=1.0, slack=0) == [0]


def test_index_blocks_grow_and_cover_what_they_say() -> None:
    text = "abcdefgh" * 2000  # 16,000 bytes
    hashes = index_hashes(text, 256)
    assert covered(len(hashes), 256) <= len(text.encode()) < covered(len(hashes) + 1, 256)
    assert len(hashes) < 16_000 // 256  # fewer than fixed blocks would be
    assert covered(8, 256) == 8 * 256 and covered(9, 256) == 8 * 256 + 512
    longer = index_hashes(text + "more", 256)
    assert longer[: len(hashes)] == hashes  # the same prefix, the same blocks


def test_a_holder_buried_in_prefill_loses_to_an_idle_replica() -> None:
    idx = PrefixIndex([1000] * 2)
    p = index_hashes(SYSTEM + "q", 64)
    idx.add(0, p)
    held = covered(len(p), 64)  # bytes; one byte a token here
    view = View([1.0, 1.0], [True, True], [False, False], [True, True], [0.0, 0.0])
    assert choose(view, index=idx, hashes=p, block_bytes=64, per_token=1.0) == (0, len(p))
    view.prefill = [held + 10.0, 0.0]  # more prefill queued there than the cache saves
    assert choose(view, index=idx, hashes=p, block_bytes=64, per_token=1.0) == (1, 0)
