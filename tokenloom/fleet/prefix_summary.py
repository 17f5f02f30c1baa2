"""What an engine replica tells the router about its prefix cache, in the router's own terms.

The prefix caches of the replicas are the fleet's completed work. A prefix-aware router learns where
prefixes are cached only from the prompts it routes itself, so a router that starts afresh (the ingress
replica restarted under `serve run`) would know nothing and scatter prefixes away from their caches.
So every replica routed to by prefix says, in each board report (board.py), which prompt prefixes it
holds, as the router hashes them (routing.prefix_hashes); the router merges that into its picture
(ray_router.py).

The replica records a prompt once its K/V is computed (the request's first output): for each full
block, the engine's prefix-cache key (kv_cache.prefix_keys, under the request's cache salt) next to the
router's hash of the same prefix. Each report first drops the blocks the engine has evicted since
(checked on the engine thread against the cache's key table, `held`) and then sends the router hashes
of the rest. The table holds at most `capacity` blocks, dropping the least recently computed first, and
evicted blocks leave it at the next report, so it never holds much more than the cache itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..engine.kv_cache import BlockKey, prefix_keys
from .routing import prefix_hashes

# Blocks a report names at most. A replica reports every second; measured: a hash adds 10 bytes to the
# pickled report (~22 KB of Prometheus text before), so 41 KB at most, and building it from a full table
# takes under 1 ms. A default replica (1 GiB of float32 KV for SmolLM2-135M) has ~2,900 blocks.
SUMMARY_CAPACITY = 4096


class PrefixSummary:
    def __init__(self, block_size: int, capacity: int = SUMMARY_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        # engine key -> (router hash, when it was last recorded), least recently recorded first
        self._blocks: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()
        self._recorded = 0

    def computed(self, prompt_ids: Sequence[int], salt: str | None = None) -> None:
        """The prompt's K/V is in the cache now (its request has produced a token)."""
        self._recorded += 1
        blocks = zip(prefix_keys(prompt_ids, self.block_size, salt), prefix_hashes(prompt_ids, self.block_size),
                     strict=True)
        # Last block first, so the first is the most recent: what is dropped first (here, and from the
        # router's picture when it is full) is a prefix's tail, never the block its others hang from.
        # The engine frees a sequence's blocks in the same order.
        for key, router_hash in reversed(list(blocks)):
            self._blocks[key] = (router_hash, self._recorded)
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def snapshot(self) -> tuple[list[BlockKey], int]:
        """The recorded blocks' keys, for the engine thread to check which it still holds, and a mark of
        this moment for `report`."""
        return list(self._blocks), self._recorded

    def report(self, keys: list[BlockKey], mark: int, held: Sequence[bool]) -> list[int]:
        """The router hashes of the prefixes still cached, oldest first, each once. `held[i]`: whether the
        cache held `keys[i]` (a `snapshot`'s, taken at `mark`). A block recorded again after the snapshot
        was computed again: it stays."""
        for key, still in zip(keys, held, strict=True):
            if not still and (entry := self._blocks.get(key)) is not None and entry[1] <= mark:
                del self._blocks[key]
        # Two salts can cache the same tokens twice, and the router hashes tokens only: each hash once,
        # where it was last recorded.
        newest_first = dict.fromkeys(router_hash for router_hash, _ in reversed(self._blocks.values()))
        return list(reversed(newest_first))
