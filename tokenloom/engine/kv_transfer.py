"""KV handed between engines (disaggregated prefill): a prefill engine exports the K/V of a prompt's
cached blocks, a decode engine imports them into its prefix cache."""

from __future__ import annotations

import torch

from ..step import Runner
from .kv_cache import KVCacheManager


class KVTransfer:
    def __init__(self, kv: KVCacheManager, runner: Runner):
        self.kv, self.runner = kv, runner

    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None):
        """(tokens, K/V) of the longest cached prefix of `token_ids` (whole blocks, held in every KV group),
        as the runner's `read_blocks` gives it, group after group; (0, None) when nothing is cached. A
        prefill engine calls this right after the prompt's request finished, while its blocks are still
        cached."""
        rows = self.kv.cached_in_every_group(self.kv.prefix_keys(token_ids, cache_salt))
        if not rows:
            return 0, None
        blocks = [row[group].block_id for group in range(self.kv.num_groups) for row in rows]
        return len(rows) * self.kv.block_size, self.runner.read_blocks(blocks)

    def import_prefix_kv(self, token_ids: list[int], kv, cache_salt: str | None = None) -> int:
        """Put another engine's K/V of `token_ids`' first blocks (export_prefix_kv) into this engine's
        prefix cache, so a request with that prompt starts from a cache hit; returns the tokens now
        cached. The blocks stay free, so memory pressure may evict them: that costs a recompute, never a
        wrong token."""
        if kv is None:
            return 0
        bs, groups = self.kv.block_size, self.kv.num_groups
        if kv.dim() < 3 or kv.shape[2] % (bs * groups):
            raise ValueError(f"kv: a {tuple(kv.shape)} tensor is not whole blocks of {bs} tokens in {groups} KV groups")
        num_blocks = kv.shape[2] // (bs * groups)  # the export's blocks per group, group after group
        keys = self.kv.prefix_keys(token_ids[: num_blocks * bs], cache_salt)
        adopted = self.kv.adopt(keys)
        if adopted:
            starts = [(group * num_blocks + i) * bs for group, i, _ in adopted]
            rows = torch.cat([torch.arange(start, start + bs) for start in starts])
            self.runner.write_blocks([b.block_id for _, _, b in adopted], kv[:, :, rows])
        return len(self.kv.cached_prefix(keys)) * bs
