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

Only full blocks are ever shared, and block tables are append-only, so a shared block is never
written again: no copy-on-write is needed.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..model.config import ModelConfig
from ..model.loader import kv_bytes_per_block_for, torch_dtype
from ..step import Sequence

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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self.free_host_blocks = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        # Prefix-cache statistics, in tokens (as vLLM counts them).
        self.prefix_queries = self.prefix_hits = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free empty + free cached)."""
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences (cached-but-free blocks count as free, like vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------

    def _keys_up_to(self, seq: Sequence, num_full_blocks: int) -> list[BlockKey]:
        bs, keys = self.block_size, seq.block_keys
        salt, adapter = seq.params.cache_salt, seq.lora.name if seq.lora is not None else None
        while len(keys) < num_full_blocks:
            i = len(keys)
            keys.append(block_key(keys[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs], salt, adapter))
        return keys[:num_full_blocks]

    def prefix_keys(self, token_ids, salt: str | None = None) -> list[BlockKey]:
        """The keys of the full blocks of `token_ids` (a base-model sequence's, under `salt`)."""
        return prefix_keys(token_ids, self.block_size, salt)

    def cached_prefix(self, keys: list[BlockKey]) -> list[KVBlock]:
        """The cached blocks holding the longest run of `keys` from the first."""
        return list(itertools.takewhile(lambda block: block is not None, (self.cached.get(k) for k in keys)))

    def adopt(self, keys: list[BlockKey]) -> list[tuple[int, KVBlock]]:
        """Make `keys` cached blocks, free for any sequence to hit (their K/V must be written before the
        next step: the caller does it at once, on the engine thread). Keys already cached are left as
        they are; returns (index in keys, block) of those given new blocks. Stops early rather than take
        more than a quarter of the free blocks (a handed-over prefix must not evict a busy engine's cache)."""
        budget = self.num_free_blocks // 4
        adopted: list[tuple[int, KVBlock]] = []
        for i, key in enumerate(keys):
            if key in self.cached:
                continue
            if len(adopted) >= budget:
                break
            block = self._take_free_block()
            block.key, block.ref_cnt = key, 0
            self.cached[key] = block
            self.free_queue.append(block)  # the most recently freed: the last to be evicted
            adopted.append((i, block))
        return adopted

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """Cached blocks holding the longest prefix of `seq`'s tokens. At least one token is always
        left to compute, because its logits are needed to sample."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self.cached_prefix(self._keys_up_to(seq, max_blocks))

    # -- allocation ------------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after any prefix-cache
        hits, which join the table; the caller counts them as computed). Returns False, changing nothing,
        when there are not enough blocks."""
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks)
        # Hits that sit in the free queue stop being free once we take them.
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.num_free_blocks - free_hits:
            return False
        for block in computed_blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            seq.block_table.append(block.block_id)
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._take_free_block().block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, total)
        return True

    def _take_free_block(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.key is not None:  # evict lazily: the cached content is overwritten only now
            if self.cached.get(block.key) is block:
                del self.cached[block.key]
            block.key = None
        block.ref_cnt = 1
        return block

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        keys = self._keys_up_to(seq, min(num_tokens, seq.num_tokens) // self.block_size)
        for key, block_id in zip(keys, seq.block_table, strict=False):
            block = self.blocks[block_id]
            if block.key is None and key not in self.cached:
                block.key = key
                self.cached[key] = block

    def free(self, seq: Sequence) -> None:
        """The one release path: finish, abort, disconnect and recompute-preemption all come here."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)
        seq.block_table = []
        self.free_host(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens' (those only rejected speculative drafts
        were written to). They hold nothing worth keeping, so they go to the front of the free queue:
        the next allocation takes them back before it evicts a cached prefix."""
        keep = self.blocks_needed(num_tokens)
        released = [self.blocks[b] for b in reversed(seq.block_table[keep:])]
        for block in released:  # checked before anything changes
            assert block.key is None and block.ref_cnt == 1, f"block {block.block_id} holds more than drafts"
        for block in released:
            block.ref_cnt = 0
            self.free_queue.appendleft(block)
        del seq.block_table[keep:]

    def reset_prefix_cache(self) -> None:
        for key, block in list(self.cached.items()):
            if block.ref_cnt == 0:
                block.key = None
                del self.cached[key]

    # -- swap ------------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_host_blocks)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s blocks to the host pool; returns (device block, host block) copies to make
        before the device blocks are reused."""
        host = [self.free_host_blocks.pop() for _ in seq.block_table]
        mapping = list(zip(seq.block_table, host, strict=True))
        self.free(seq)  # frees the device blocks; the host blocks are attached only after
        seq.host_blocks = host
        return mapping

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back; returns (host block, device block) copies, or None if the
        device has no room."""
        if len(seq.host_blocks) > self.num_free_blocks:
            return None
        device = [self._take_free_block().block_id for _ in seq.host_blocks]
        mapping = list(zip(seq.host_blocks, device, strict=True))
        self.free_host(seq)
        seq.block_table = device
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
            for block_id in seq.block_table:
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
