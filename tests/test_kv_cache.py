"""KV-cache manager: allocation, prefix-cache sharing, LRU eviction, swap, and a property-based
test driving random operation sequences while checking the accounting invariants after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenloom import SamplingParams
from tokenloom.engine.kv_cache import KVCacheManager, held_blocks
from tokenloom.step import HOLE, Sequence

PARAMS = SamplingParams(max_tokens=8)


def seq_of(tokens, name="s") -> Sequence:
    return Sequence(name, 0, list(tokens), PARAMS)


def admit(kv: KVCacheManager, seq: Sequence) -> bool:
    hits = kv.get_computed_blocks(seq)
    new = seq.num_tokens - len(hits) * kv.block_size
    if not kv.allocate_slots(seq, new, hits):
        return False
    seq.num_computed_tokens = seq.num_tokens  # as the engine does after the forward
    return True


def test_allocation_rounds_up_to_blocks_and_free_returns_all():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = seq_of(range(9))
    assert admit(kv, s)
    assert len(s.block_table) == 3 and kv.num_free_blocks == 7
    kv.free(s)
    assert kv.all_free() and s.block_table == []


def test_prefix_hit_shares_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq_of(range(12), "a")
    assert admit(kv, a)
    b = seq_of(range(12), "b")  # identical prompt: 2 full blocks hit, the last block is recomputed
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h, in hits] == a.block_table[:2]
    assert kv.allocate_slots(b, 12 - 8, hits)
    assert b.num_computed_tokens == 0  # the scheduler counts the hits as computed
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert kv.blocks[a.block_table[0]].ref_cnt == 2
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = seq_of([1, 2, 3, 4, 5], "a")  # 3 blocks: [1,2] [3,4] [5]
    assert admit(kv, a)
    kv.free(a)
    assert kv.all_free() and len(kv.cached) == 2
    b = seq_of([1, 2, 3, 4, 9], "b")
    assert len(kv.get_computed_blocks(b)) == 2  # still cached after free
    # A different 8-token sequence needs all 4 blocks: every cached block is evicted.
    c = seq_of([7] * 8, "c")
    assert admit(kv, c)
    assert kv.get_computed_blocks(b) == []
    kv.free(c)


def test_eviction_takes_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    old = seq_of([1, 2, 3], "old")
    new = seq_of([4, 5, 6], "new")
    assert admit(kv, old)
    kv.free(old)
    assert admit(kv, new)
    kv.free(new)
    # One block needed beyond the 4 never-cached ones: the older cached block goes first.
    d = seq_of([9] * 10, "d")
    assert admit(kv, d)
    assert kv.get_computed_blocks(seq_of([1, 2, 3])) == []
    assert len(kv.get_computed_blocks(seq_of([4, 5, 6]))) == 1
    kv.free(d)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = seq_of(range(8), "a")
    assert admit(kv, a)
    b = seq_of(range(100, 110), "b")
    assert not kv.allocate_slots(b, 10)
    assert b.block_table == [] and kv.num_free_blocks == 1
    kv.check_invariants([a])
    kv.free(a)


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=4)
    a = seq_of(range(10), "a")
    assert admit(kv, a)
    out = kv.swap_out(a)
    assert len(out) == 3 and a.block_table == [] and len(a.host_blocks) == 3
    assert kv.num_free_blocks == 4
    kv.check_invariants([a])
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in out] and len(a.block_table) == 3
    kv.check_invariants([a])
    kv.free(a)
    assert kv.all_free()


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / share / free / evict / swap; invariants checked after every rule."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=4, num_host_blocks=12)
        self.live: list[Sequence] = []
        self.count = 0

    def _new(self, tokens) -> None:
        self.count += 1
        seq = seq_of(tokens, f"s{self.count}")
        if admit(self.kv, seq):
            self.live.append(seq)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def allocate(self, tokens):
        self._new(tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=10))
    def share_prefix(self, data, extra):
        src = data.draw(st.sampled_from(self.live))
        cut = data.draw(st.integers(1, src.num_tokens))
        self._new(src.token_ids[:cut] + extra)

    @precondition(lambda self: any(not s.host_blocks for s in self.live))
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from([s for s in self.live if not s.host_blocks]))
        seq.token_ids.extend([1] * n)
        if self.kv.allocate_slots(seq, n):
            seq.num_computed_tokens += n
        else:
            del seq.token_ids[-n:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.kv.free(seq)
        self.live.remove(seq)

    @rule(tokens=st.lists(st.integers(4, 6), min_size=40, max_size=80))
    def pressure_evicts(self, tokens):
        self._new(tokens)  # a long unrelated sequence forces evictions when it fits at all

    @precondition(lambda self: any(s.block_table and self.kv.can_swap_out(s) for s in self.live))
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.block_table and self.kv.can_swap_out(s)]))
        self.kv.swap_out(seq)

    @precondition(lambda self: any(s.host_blocks for s in self.live))
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.host_blocks]))
        self.kv.swap_in(seq)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def accounting_holds(self):
        self.kv.check_invariants(self.live)
        in_use = sum(1 for b in self.kv.blocks if b.ref_cnt > 0)
        assert self.kv.num_free_blocks + in_use == self.kv.num_blocks

    def teardown(self):
        for seq in self.live:
            self.kv.free(seq)
        assert self.kv.all_free()


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedKVMachine(KVMachine):
    """The same rules on a cache with sliding-window groups (Gemma 3's layout in small): one full group and
    two whose tables release blocks behind a 6-token window. Besides the accounting, every block a next
    query reads is still held, and every held block that is cached holds this sequence's tokens."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=48, block_size=4, num_host_blocks=24, windows=(None, 6, 6))

    @invariant()
    def windows_hold_what_the_next_query_reads(self):
        for seq in self.live:
            if seq.host_blocks:
                continue
            for group, (table, window) in enumerate(zip(seq.block_tables, self.kv.windows, strict=True)):
                # The next query, at position num_computed_tokens, reads the window's positions before it.
                first = 0 if window is None else max(seq.num_computed_tokens - window + 1, 0) // self.kv.block_size
                assert HOLE not in table[first:], f"{seq.seq_id} group {group} released a block its window reads"
                for i, block_id in enumerate(table[: len(seq.block_keys)]):
                    key = self.kv.blocks[block_id].key if block_id != HOLE else None
                    assert key in (None, self.kv._group_key(seq.block_keys[i], group)), "a block holds other tokens"


TestWindowedKVMachine = WindowedKVMachine.TestCase
TestWindowedKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_sliding_group_releases_blocks_behind_its_window_and_a_hit_needs_only_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, windows=(None, 6))
    a = seq_of(list(range(40)), "a")
    assert admit(kv, a)
    assert held_blocks(a)[:10] == a.block_table and len(a.block_tables[1]) == 10
    a.token_ids.append(99)
    assert kv.allocate_slots(a, 1)  # the query at position 40 reads positions 35..40: blocks 8 to 10
    assert a.block_tables[1][:8] == [HOLE] * 8 and HOLE not in a.block_tables[1][8:]
    assert kv.num_free_blocks == 64 - 11 - 3
    # A new sequence with the same 40 tokens hits blocks 0-8 in the full group (one token left to
    # compute) and, in the sliding group, only blocks 7 and 8, which its position 36 reads.
    b = seq_of(list(range(40)), "b")
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 9 and all(row[0] is not None for row in hits)
    assert [row[1] is not None for row in hits] == [False] * 7 + [True] * 2
    assert kv.allocate_slots(b, 4, hits)
    kv.check_invariants([a, b])
    assert kv.most_blocks_held(1000, step_tokens=8) == 250 + kv.blocks_needed(6 - 1 + 8) + 1


def test_a_swapped_sequence_copies_only_its_window_and_comes_back():
    """Preempted before its allocation in a step, a sequence still holds blocks behind its window: swap-out
    releases them instead of copying them, so what swap-in asks for fits a pool the sequence fits."""
    kv = KVCacheManager(num_blocks=24, block_size=4, num_host_blocks=24, windows=(None, 8))
    seq = seq_of(range(64), "s")
    for _ in range(3):  # three chunks of 16; the engine advances the computed count after each
        assert kv.allocate_slots(seq, 16)
        seq.num_computed_tokens += 16
    assert kv.most_blocks_held(65, 16) <= kv.num_blocks
    copies = kv.swap_out(seq)
    assert len(copies) == 12 + 2  # the full group's 12 blocks; of the sliding group's, blocks 10 and 11
    assert kv.blocks_to_swap_in(seq, 16) <= kv.num_free_blocks
    assert kv.swap_in(seq) is not None and kv.allocate_slots(seq, 16)
    kv.check_invariants([seq])
