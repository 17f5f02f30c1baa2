"""The routing policies (tokenloom/fleet/routing.py) on hand-made replica loads, and what a replica reports
of its prefix cache for them (fleet/prefix_summary.py): no Ray needed."""

import pytest

from tokenloom.engine.kv_cache import KVCacheManager, prefix_keys
from tokenloom.fleet.prefix_summary import PrefixSummary
from tokenloom.fleet.routing import (
    LeastLoaded,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    make_policy,
    prefix_hashes,
)

A, B, C = (ReplicaLoad(x) for x in "abc")


def test_round_robin_takes_turns_and_skips_the_sick():
    p = RoundRobin()
    firsts = [p.rank([], [A, B, C])[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    sick = ReplicaLoad("b", health_problem="no step for 60 s")
    ranks = [p.rank([], [A, sick, C]) for _ in range(4)]
    assert all(r[-1] == "b" for r in ranks)  # only as a last resort
    assert {r[0] for r in ranks} == {"a", "c"}


def test_least_loaded_counts_what_it_sent_then_the_reported_queue():
    p = LeastLoaded()
    p.routed("a", [])
    p.routed("a", [])
    p.routed("b", [])
    assert p.rank([], [A, B, C]) == ["c", "b", "a"]
    p.completed("a")
    p.completed("a")
    busy_b = ReplicaLoad("b", waiting=3)
    assert p.rank([], [A, busy_b])[0] == "a"  # a: 0 in flight; b: 1
    p.completed("b")
    assert p.rank([], [A, busy_b])[0] == "a"  # equal in flight: b reports a queue


def test_prefix_hashes_cover_whole_blocks_and_chain():
    assert prefix_hashes(list(range(15)), 16) == []
    h1 = prefix_hashes(list(range(40)), 16)
    assert len(h1) == 2
    h2 = prefix_hashes([*range(16), *range(100, 124)], 16)
    assert h2[0] == h1[0] and h2[1] != h1[1]  # same first block, different second
    assert prefix_hashes([*range(16, 32), *range(16)], 16)[1] != h1[0]  # a block's hash depends on what precedes


def test_prefix_aware_sends_a_shared_prefix_back_where_it_is_cached():
    p = PrefixAware(block_size=4)
    system_1, system_2 = list(range(100, 132)), list(range(200, 232))
    first = p.rank([*system_1, 1, 2, 3, 4], [A, B])[0]
    p.routed(first, [*system_1, 1, 2, 3, 4])
    second = p.rank([*system_2, 5, 6, 7, 8], [A, B])[0]
    assert second != first  # a new prefix goes where less is cached
    p.routed(second, [*system_2, 5, 6, 7, 8])
    for user in range(10):
        ids = [*system_1, user, user, user, user, user]
        assert p.rank(ids, [A, B])[0] == first
        assert p.matched_blocks(first, prefix_hashes(ids, 4)) == 8


def test_prefix_aware_rebalances_a_hot_replica():
    p = PrefixAware(block_size=4, balance_abs_threshold=2, balance_rel_threshold=1.5)
    ids = list(range(64))
    p.routed("a", ids)
    assert p.rank(ids, [A, B])[0] == "a"
    for _ in range(3):
        p.routed("a", ids)
    assert p.rank(ids, [A, B])[0] == "b"  # a has 4 in flight, b none


def test_prefix_aware_forgets_old_prefixes_and_dead_replicas():
    p = PrefixAware(block_size=2, blocks_per_replica=4)
    p.routed("a", [1, 2, 3, 4, 5, 6, 7, 8])
    p.routed("a", [9, 10, 11, 12])
    assert p.matched_blocks("a", prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)) == 0  # evicted (4 blocks kept)
    assert p.matched_blocks("a", prefix_hashes([9, 10, 11, 12], 2)) == 2
    p.forget("a")
    assert p.matched_blocks("a", prefix_hashes([9, 10, 11, 12], 2)) == 0 and "a" not in p.in_flight


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="block_size"):
        make_policy("prefix-aware", block_size=0)


def _cache_report(summary: PrefixSummary, kv: KVCacheManager) -> list[int]:
    """A replica's report (fleet/replica.py), its engine thread's part done in line."""
    keys, mark = summary.snapshot()
    return summary.report(keys, mark, [key in kv.cached for key in keys])


def test_a_fresh_router_learns_where_prefixes_are_cached_from_the_replicas_reports():
    """The router restarts (its ingress replica died): with the replicas' reports it sends each shared
    prefix where the old router did, where a blind one would scatter them."""
    systems = [list(range(100 * s, 100 * s + 32)) for s in range(1, 5)]
    old = PrefixAware(block_size=4)
    summaries = {rid: PrefixSummary(block_size=4) for rid in "ab"}
    caches = {rid: KVCacheManager(num_blocks=256, block_size=4) for rid in "ab"}
    home = {}
    for s, system in enumerate(systems):
        for user in range(3):
            ids = [*system, s, user, user, user]
            rid = old.rank(ids, [A, B])[0]
            old.routed(rid, ids)
            old.completed(rid)
            home.setdefault(s, rid)
            assert rid == home[s]
            summaries[rid].computed(ids)  # the replica computed the prompt: now in its cache
            caches[rid].adopt(prefix_keys(ids, 4))
    assert set(home.values()) == {"a", "b"}

    blind = PrefixAware(block_size=4)
    fresh = PrefixAware(block_size=4)
    for rid in "ab":
        fresh.cache_reported(rid, _cache_report(summaries[rid], caches[rid]))
    blind_homes = set()
    for s, system in enumerate(systems):
        ids = [*system, s, 9, 9, 9]
        blind_homes.add(blind.rank(ids, [A, B])[0] == home[s])
        assert fresh.rank(ids, [A, B])[0] == home[s]
        assert fresh.matched_blocks(home[s], prefix_hashes(ids, 4)) == 8  # the system prompt's blocks
    assert blind_homes != {True}  # without the reports, some prefix would have gone elsewhere


def test_reported_prefixes_fill_only_the_room_that_routed_ones_leave():
    p = PrefixAware(block_size=2, blocks_per_replica=6)
    p.routed("a", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 blocks
    summary, kv = PrefixSummary(block_size=2), KVCacheManager(num_blocks=64, block_size=2)
    summary.computed([9, 10, 11, 12, 13, 14])
    kv.adopt(prefix_keys([9, 10, 11, 12, 13, 14], 2))
    p.cache_reported("a", _cache_report(summary, kv))  # 3 blocks, room for 2
    assert p.matched_blocks("a", prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)) == 4
    assert p.matched_blocks("a", prefix_hashes([9, 10, 11, 12, 13, 14], 2)) == 2  # the tail block went
    p.cache_reported("a", prefix_hashes([1, 2, 3, 4], 2))  # already known: nothing moves
    assert list(p.cached["a"])[-4:] == prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    for other in (RoundRobin(), LeastLoaded()):
        other.cache_reported("a", [1, 2, 3])  # no use for it; no error


def test_a_replica_reports_the_prefixes_its_cache_still_holds():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    summary = PrefixSummary(block_size=4)
    shared, tail_1, tail_2 = list(range(8)), list(range(50, 54)), list(range(60, 64))
    summary.computed([*shared, *tail_1, 1, 2])  # the partial last block is never cached: not reported
    summary.computed([*shared, *tail_2])
    summary.computed([*shared, *tail_2], salt="tenant")  # same tokens under another salt: other keys
    kv.adopt(prefix_keys([*shared, *tail_1], 4))
    kv.adopt(prefix_keys([*shared, *tail_2], 4, salt="tenant"))
    # tail_2's unsalted block is not held; the salted copy still names its hash. Each hash once, oldest
    # first, and a prefix's tail before the blocks it hangs from.
    (s1, s2, t1), t2 = prefix_hashes([*shared, *tail_1], 4), prefix_hashes([*shared, *tail_2], 4)[2]
    assert _cache_report(summary, kv) == [t1, t2, s2, s1]

    kv.reset_prefix_cache()  # all evicted...
    keys, mark = summary.snapshot()
    summary.computed([*shared, *tail_1])  # ...and this one computed again after the snapshot: it stays
    assert summary.report(keys, mark, [key in kv.cached for key in keys]) == [t1, s2, s1]
    assert _cache_report(summary, kv) == []  # until a report after it finds it evicted


def test_a_prefix_summary_is_bounded():
    summary = PrefixSummary(block_size=2, capacity=3)
    summary.computed([1, 2, 3, 4, 5, 6])
    summary.computed([7, 8, 9, 10])
    keys, mark = summary.snapshot()
    assert len(keys) == 3
    first, second = prefix_hashes([1, 2, 3, 4, 5, 6], 2), prefix_hashes([7, 8, 9, 10], 2)
    assert summary.report(keys, mark, [True] * 3) == [first[0], second[1], second[0]]  # tails dropped first
    with pytest.raises(ValueError, match="capacity"):
        PrefixSummary(block_size=2, capacity=0)
