"""The routing policies (tokenloom/fleet/routing.py) on hand-made replica loads: no Ray needed."""

import pytest

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
