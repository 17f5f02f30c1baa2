"""Paged KV-cache bookkeeping: the block pool, per-sequence block tables, the prefix cache, swap.

Only block *ids* live here; the K/V tensors belong to the runner. Every device block is in exactly
one of three states, which `check_invariants()` verifies:

- in use: `ref_cnt > 0`, referenced by that many block tables (shared prefix blocks have ref > 1);
- free and cached: `ref_cnt == 0`, still holding a prefix-cache key, in the free queue (reusable
  by a cache hit until it is evicted);
- free and empty: `ref_cnt == 0`, no key, in the free queue.

Prefix caching: a *full* block is identified by its key, SHA-256 over the parent block's key and the
block's token ids (the first block's over the request's `cache_salt` instead of a parent); a sequence's
keys chain from its first block, so equal keys mean equal prefixes under the same salt. A collision-
resistant hash because a collision would hand one request another's KV (Python's `hash()` of tuples is
not: vLLM's CVE-2025-25183 is this class), and a salt because tenants that must not learn each other's
prompts through cache hits (TTFT, the hit counters) must not share blocks at all. Keys
are registered when a block is allocated for the tokens that fill it (the forward that computes it
runs before anything else can read it), and dropped only when a free block is taken for reuse
(LRU eviction: the free queue hands out the least recently freed block first, and a sequence's
blocks are freed tail first so its prefix stays longest).

KV groups (model/kv_layout.py): a model with sliding-window layers has a table per group, all drawing
from this one pool, and a group's cache keys are the block keys tagged with the group. A sliding
group's table releases the blocks its window has left behind as the sequence advances: the entries
become HOLE (always a prefix of the table), and the blocks stay cached until evicted, oldest last.

Only full blocks are ever shared, and a table only grows at its end (besides those released entries),
so a shared block is never written again: no copy-on-write is needed.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.kv_layout import window_start
from ..model.loader import kv_bytes_per_block_for, torch_dtype
from ..step import HOLE, Sequence

if TYPE_CHECKING:
    import torch

BlockKey = bytes  # SHA-256 digest of the block's prefix: see block_key


def block_key(parent: BlockKey | None, token_ids, salt: str | None = None, adapter: str | None = None) -> BlockKey:
    """The prefix-cache key of a full block: SHA-256 over a tag, the parent's key (or, for the first
    block, the salt and the LoRA adapter's name, each length-prefixed so no value is a prefix of another's
    encoding: KV computed under one adapter is never another's or the base model's) and the token ids as
    fixed-width unsigned 32-bit integers (a block always holds block_size of them)."""
    h = hashlib.sha256()
    if parent is None:
        h.update(b"first\0")
        for value in (salt or "", adapter or ""):
            encoded = value.encode("utf-8", "surrogatepass")
            h.update(len(encoded).to_bytes(8, "little") + encoded)
    else:
        h.update(b"next\0" + parent)
    h.update(array("I", token_ids).tobytes())
    return h.digest()


def prefix_keys(token_ids, block_size: int, salt: str | None = None) -> list[BlockKey]:
    """The keys of the full blocks of `token_ids` (a base-model sequence's, under `salt`): what a cache of
    `block_size`-token blocks would hold them under. Pure: a fleet replica computes them off the engine
    thread (fleet/prefix_summary.py)."""
    keys: list[BlockKey] = []
    for i in range(len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else None, token_ids[i * block_size : (i + 1) * block_size], salt))
    return keys


def kv_cache_size(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype | None = None
                  ) -> tuple[int, int, int]:
    """(device blocks, host blocks for swap, bytes per block) that the config's memory budget holds, for
    a cache of `kv_dtype` (default: the config's `dtype`)."""
    block_bytes = kv_bytes_per_block_for(model_config, config.block_size, kv_dtype or torch_dtype(config.dtype))
    num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes: {config.kv_cache_memory_bytes} holds fewer than 2 blocks of {block_bytes} bytes"
        )
    num_host_blocks = int(config.swap_space * (1 << 30)) // block_bytes if config.preemption_mode == "swap" else 0
    return num_blocks, num_host_blocks, block_bytes


class KVBlock:
    __slots__ = ("block_id", "key", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: BlockKey | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) pop-front, append and remove-from-middle
    (a cache hit takes a free block out of the queue wherever it is)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self.head, self.tail = KVBlock(-1), KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.size += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self.head.next
        self.head.next, block.prev, block.next, first.prev = block, self.head, first, block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        if self.size == 0:
            raise RuntimeError("no free KV blocks")
        block = self.head.next
        self.remove(block)
        return block

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0,
                 windows: tuple[int | None, ...] = (None,)):
        """`windows`: per KV group (model/kv_layout.py), None (its table keeps every block) or the sliding
        window whose older blocks its table releases."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self.free_host_blocks = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        # Prefix-cache statistics, in tokens (as vLLM counts them).
        self.prefix_queries = self.prefix_hits = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def prefix_capacity(self) -> int:
        """How many blocks of a prompt the pool holds in every group at once (what a router mirroring
        this cache counts; the pool's blocks when there is one group)."""
        return self.num_blocks // self.num_groups

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free empty + free cached)."""
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences (cached-but-free blocks count as free, like vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one group's table that cover `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence growing to `num_tokens` holds at once, in steps of at most
        `step_tokens` tokens: a sliding group holds its window's blocks and the step's."""
        every = self.blocks_needed(num_tokens)
        return sum(every if w is None else min(every, self.blocks_needed(w - 1 + step_tokens) + 1)
                   for w in self.windows)

    def _first_in_window(self, position: int, window: int | None) -> int:
        """The first block a query at `position` reads in a group of that window (0: full attention)."""
        return window_start(position, window) // self.block_size

    # -- prefix cache ----------------------------------------------------------------------------

    def _keys_up_to(self, seq: Sequence, num_full_blocks: int) -> list[BlockKey]:
        bs, keys = self.block_size, seq.block_keys
        salt, adapter = seq.params.cache_salt, seq.lora.name if seq.lora is not None else None
        while len(keys) < num_full_blocks:
            i = len(keys)
            keys.append(block_key(keys[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs], salt, adapter))
        return keys[:num_full_blocks]

    @staticmethod
    def _group_key(key: BlockKey, group: int) -> BlockKey:
        """The cache key of a block's K/V in `group` (group 0's is the block key itself)."""
        return key if group == 0 else key + group.to_bytes(2, "little")

    def prefix_keys(self, token_ids, salt: str | None = None) -> list[BlockKey]:
        """The keys of the full blocks of `token_ids` (a base-model sequence's, under `salt`)."""
        return prefix_keys(token_ids, self.block_size, salt)

    def cached_prefix(self, keys: list[BlockKey]) -> list[tuple[KVBlock | None, ...]]:
        """The longest run of `keys` from the first whose K/V is cached: per block, its block in each
        group. A sliding group needs only the blocks its window reaches back to from the run's end; its
        older entries are None."""
        rows: list[tuple[KVBlock | None, ...]] = []
        for row in self._cached_rows(keys):
            if any(block is None for block, w in zip(row, self.windows, strict=True) if w is None):
                break
            rows.append(row)
        n = len(rows)
        while n and any(row[g] is None for g, w in enumerate(self.windows) if w is not None
                        for row in rows[self._first_in_window(n * self.block_size, w) : n]):
            n -= 1
        firsts = [self._first_in_window(n * self.block_size, w) for w in self.windows]
        return [tuple(block if i >= first else None for block, first in zip(row, firsts, strict=True))
                for i, row in enumerate(rows[:n])]

    def cached_in_every_group(self, keys: list[BlockKey]) -> list[tuple[KVBlock, ...]]:
        """The longest run of `keys` from the first whose K/V every group holds (what one engine hands
        another: `LLMEngine.export_prefix_kv`)."""
        return list(itertools.takewhile(lambda row: None not in row, self._cached_rows(keys)))

    def _cached_rows(self, keys: list[BlockKey]):
        """Per key, its cached block in each group (None where not cached)."""
        for key in keys:
            yield tuple(self.cached.get(self._group_key(key, g)) for g in range(self.num_groups))

    def adopt(self, keys: list[BlockKey]) -> list[tuple[int, int, KVBlock]]:
        """Make `keys` cached blocks in every group, free for any sequence to hit (their K/V must be written
        before the next step: the caller does it at once, on the engine thread). Keys already cached are
        left as they are; returns (group, index in keys, block) of those given new blocks. Stops early
        rather than take more than a quarter of the free blocks (a handed-over prefix must not evict a
        busy engine's cache)."""
        budget = self.num_free_blocks // 4
        adopted: list[tuple[int, int, KVBlock]] = []
        for i, key in enumerate(keys):
            for group in range(self.num_groups):
                group_key = self._group_key(key, group)
                if group_key in self.cached:
                    continue
                if len(adopted) >= budget:
                    return adopted
                block = self._take_free_block()
                block.key, block.ref_cnt = group_key, 0
                self.cached[group_key] = block
                self.free_queue.append(block)  # the most recently freed: the last to be evicted
                adopted.append((group, i, block))
        return adopted

    def get_computed_blocks(self, seq: Sequence) -> list[tuple[KVBlock | None, ...]]:
        """Cached blocks holding the longest prefix of `seq`'s tokens (see `cached_prefix`). At least one
        token is always left to compute, because its logits are needed to sample."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or seq.params.pool_hidden:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self.cached_prefix(self._keys_up_to(seq, max_blocks))

    # -- allocation ------------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[tuple[KVBlock | None, ...]] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after any prefix-cache
        hits, which join the tables; the caller counts them as computed). Returns False when there are
        not enough blocks, changing nothing but releasing blocks that fell behind a sliding window."""
        tables = seq.block_tables or [[] for _ in self.windows]
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size  # the step's first position
        self._release_behind_windows(tables, start)
        num_blocks = self.blocks_needed(start + num_new_tokens)
        num_new_blocks = sum(max(num_blocks - len(table) - len(computed_blocks), 0) for table in tables)
        # Hits that sit in the free queue stop being free once we take them.
        free_hits = sum(1 for row in computed_blocks for b in row if b is not None and b.ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - free_hits:
            return False
        seq.block_tables = tables
        for row in computed_blocks:
            for table, block in zip(tables, row, strict=True):
                if block is None:
                    table.append(HOLE)
                    continue
                if block.ref_cnt == 0:
                    self.free_queue.remove(block)
                block.ref_cnt += 1
                table.append(block.block_id)
        for table in tables:
            table.extend(self._take_free_block().block_id for _ in range(num_blocks - len(table)))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start + num_new_tokens)
        return True

    def _release_behind_windows(self, tables: list[list[int]], position: int) -> None:
        """Release the blocks of each sliding group that no query at `position` or later reads (their
        cached K/V stays a prefix-cache entry until evicted). The table's released entries are a prefix,
        and it keeps its length: positions still index it."""
        for table, window in zip(tables, self.windows, strict=True):
            first = min(self._first_in_window(position, window), len(table))
            for i in reversed(range(bisect.bisect_left(table, True, hi=first, key=_is_block), first)):
                self._release(table[i])  # newest first, as `free` does: the oldest stays cached longest
                table[i] = HOLE

    def _take_free_block(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.key is not None:  # evict lazily: the cached content is overwritten only now
            if self.cached.get(block.key) is block:
                del self.cached[block.key]
            block.key = None
        block.ref_cnt = 1
        return block

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the blocks that became full since the last call to the prefix cache (a block whose key
        another block already holds stays out of it)."""
        keys = self._keys_up_to(seq, min(num_tokens, seq.num_tokens) // self.block_size)
        for group, table in enumerate(seq.block_tables):
            for i in range(seq.num_registered_blocks, min(len(keys), len(table))):
                if table[i] == HOLE:
                    continue
                block, key = self.blocks[table[i]], self._group_key(keys[i], group)
                if block.key is None and key not in self.cached:
                    block.key = key
                    self.cached[key] = block
        seq.num_registered_blocks = max(seq.num_registered_blocks, min(len(keys), *map(len, seq.block_tables)))

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block_id} freed twice"
        if block.ref_cnt == 0:
            self.free_queue.append(block)

    def free(self, seq: Sequence) -> None:
        """The one release path: finish, abort, disconnect and recompute-preemption all come here.
        Tail first, each block in every group before the one before it: the prefix stays cached longest."""
        tables = seq.block_tables
        for i in reversed(range(max(map(len, tables), default=0))):
            for table in tables:
                if i < len(table) and table[i] != HOLE:
                    self._release(table[i])
        seq.block_tables = []
        seq.num_registered_blocks = 0
        self.free_host(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens' (those only rejected speculative drafts
        were written to). They hold nothing worth keeping, so they go to the front of the free queue:
        the next allocation takes them back before it evicts a cached prefix."""
        keep = self.blocks_needed(num_tokens)
        assert all(b != HOLE for table in seq.block_tables for b in table[keep:]), "a draft block was released"
        released = [self.blocks[b] for table in seq.block_tables for b in reversed(table[keep:])]
        for block in released:  # checked before anything changes
            assert block.key is None and block.ref_cnt == 1, f"block {block.block_id} holds more than drafts"
        for block in released:
            block.ref_cnt = 0
            self.free_queue.appendleft(block)
        for table in seq.block_tables:
            del table[keep:]

    def reset_prefix_cache(self) -> None:
        for key, block in list(self.cached.items()):
            if block.ref_cnt == 0:
                block.key = None
                del self.cached[key]

    # -- swap ------------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(held_blocks(seq)) - self._behind_windows(seq) <= len(self.free_host_blocks)

    def _behind_windows(self, seq: Sequence) -> int:
        """Blocks `seq` still holds that its next query (at `num_computed_tokens`) does not read."""
        return sum(sum(1 for b in table[: self._first_in_window(seq.num_computed_tokens, w)] if b != HOLE)
                   for table, w in zip(seq.block_tables, self.windows, strict=False) if w is not None)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks to the host pool; returns (device block, host block) copies to make
        before the device blocks are reused. Blocks behind a window are released first, not copied (a
        sequence preempted before its allocation this step still holds them). The tables keep their
        released entries, so `swap_in` knows where each group's blocks resume."""
        if seq.block_tables:
            self._release_behind_windows(seq.block_tables, seq.num_computed_tokens)
        device = held_blocks(seq)
        host = [self.free_host_blocks.pop() for _ in device]
        released = [table.count(HOLE) for table in seq.block_tables]
        self.free(seq)  # frees the device blocks; the host blocks are attached only after
        seq.host_blocks = host
        seq.block_tables = [[HOLE] * n for n in released]
        return list(zip(device, host, strict=True))

    def blocks_to_swap_in(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks a swapped sequence needs to come back and compute `num_new_tokens` more."""
        grow = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - self._swapped_table_len(seq)
        return len(seq.host_blocks) + self.num_groups * max(grow, 0)

    def _swapped_table_len(self, seq: Sequence) -> int:
        released = sum(map(len, seq.block_tables))
        return (len(seq.host_blocks) + released) // self.num_groups

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back; returns (host block, device block) copies, or None if the
        device has no room."""
        if len(seq.host_blocks) > self.num_free_blocks:
            return None
        length = self._swapped_table_len(seq)
        tables = seq.block_tables or [[] for _ in self.windows]
        device: list[int] = []
        for table in tables:  # in the order swap_out listed them
            new = [self._take_free_block().block_id for _ in range(length - len(table))]
            table.extend(new)
            device.extend(new)
        mapping = list(zip(seq.host_blocks, device, strict=True))
        self.free_host(seq)
        seq.block_tables = tables
        return mapping

    def free_host(self, seq: Sequence) -> None:
        self.free_host_blocks.extend(reversed(seq.host_blocks))
        seq.host_blocks = []

    # -- checking --------------------------------------------------------------------------------

    def check_invariants(self, live: Iterable[Sequence] = ()) -> None:
        """Raise AssertionError if the accounting is inconsistent; `live` = every unfinished sequence."""
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.size, "free queue size is off"
        refs = [0] * self.num_blocks
        host_used = 0
        for seq in live:
            assert len(seq.block_tables) in (0, self.num_groups), f"{seq.seq_id} has {len(seq.block_tables)} tables"
            for table in seq.block_tables:
                assert table[: table.count(HOLE)] == [HOLE] * table.count(HOLE), f"{seq.seq_id}: a hole after a block"
            for block_id in held_blocks(seq):
                refs[block_id] += 1
            host_used += len(seq.host_blocks)
        for block in self.blocks:
            assert block.ref_cnt == refs[block.block_id], f"block {block.block_id}: ref {block.ref_cnt} != tables {refs[block.block_id]}"
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), f"block {block.block_id} free state wrong"
            if block.key is not None:
                assert self.cached.get(block.key) is block, f"block {block.block_id} key not in cache map"
        for key, block in self.cached.items():
            assert block.key == key, "cache map points at a block with another key"
        assert host_used + len(self.free_host_blocks) == self.num_host_blocks, "host blocks leaked"
        assert len(set(self.free_host_blocks)) == len(self.free_host_blocks), "host block freed twice"

    def all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and len(self.free_host_blocks) == self.num_host_blocks


def held_blocks(seq: Sequence) -> list[int]:
    """The device blocks `seq` holds, group by group in table order (released entries left out)."""
    return [b for table in seq.block_tables for b in table if b != HOLE]


def _is_block(entry: int) -> bool:
    return entry != HOLE
