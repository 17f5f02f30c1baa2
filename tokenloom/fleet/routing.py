"""Which replica serves a request: round-robin, least-loaded, or prefix-aware.

Pure Python, no Ray: the Ray Serve request router (ray_router.py) asks a policy for its ranking of
the live replicas, and the fleet simulator (sim/fleet.py) asks the same policy about simulated ones.

Load is what this router has sent a replica and not yet seen finish (`routed` / `completed`), the one
count that is never stale; the replica's own figures (waiting, running, KV usage), reported every
second or so, break ties and keep unhealthy replicas out.

Prefix-aware routing keeps, per replica, an approximate picture of what its prefix cache holds: the
chained hashes of the prompt blocks it was sent (a hash stands for a whole prefix, as in the engine's
own cache), bounded by the replica's KV block count and dropped least recently used first, plus what
the replicas report they still hold (`cache_reported`: a router that starts afresh learns the prefixes
cached before it, see fleet/prefix_summary.py). A request
goes to the replica holding its longest prefix while the load is balanced; when one replica is hot
(its load beyond the least loaded one's by both an absolute and a relative margin) the least loaded
replica gets it. With no useful match it goes to the replica caching the least, which spreads
distinct prefixes over the fleet. (The shape of SGLang's cache-aware router; the names of its
thresholds are kept.)
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("round-robin", "least-loaded", "prefix-aware")


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica last reported about itself (all optional: a new replica has reported nothing)."""

    replica_id: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0-1
    health_problem: str | None = None


class RoutingPolicy(ABC):
    """Ranks replicas for one request; tracks what it sent where. A policy says how it ranks the
    healthy replicas (`_rank_healthy`)."""

    name = "base"

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}

    def rank(self, prompt_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> list[str]:
        """The replica ids best first; unhealthy replicas last (used only when nothing else is left)."""
        healthy = [r for r in replicas if r.health_problem is None]
        sick = [r.replica_id for r in replicas if r.health_problem is not None]
        return [*self._rank_healthy(prompt_ids, healthy), *sick] if healthy else sick

    @abstractmethod
    def _rank_healthy(self, prompt_ids: Sequence[int], replicas: Sequence[ReplicaLoad]) -> list[str]:
        """The healthy replicas' ids, best first."""

    def load(self, replica: ReplicaLoad) -> tuple:
        return (self.in_flight.get(replica.replica_id, 0), replica.waiting + replica.running, replica.kv_usage)

    def by_load(self, replicas: Sequence[ReplicaLoad]) -> list[str]:
        return [r.replica_id for r in sorted(replicas, key=lambda r: (self.load(r), r.replica_id))]

    def routed(self, replica_id: str, prompt_ids: Sequence[int]) -> None:
        """A request went to the replica: in flight there until `completed`, its prompt remembered."""
        self.sent(replica_id)
        self.placed(replica_id, prompt_ids)

    def sent(self, replica_id: str) -> None:
        """A request is on its way to the replica: counted in flight until `completed`."""
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def placed(self, replica_id: str, prompt_ids: Sequence[int]) -> None:
        """The replica took a request with this prompt. Only prefix-aware routing has a use for it."""

    def completed(self, replica_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def forget(self, replica_id: str) -> None:
        """The replica is gone (died, scaled down): drop what is known about it."""
        self.in_flight.pop(replica_id, None)

    def cache_reported(self, replica_id: str, hashes: Sequence[int]) -> None:
        """The replica says its prefix cache holds these `prefix_hashes`, oldest first. Only prefix-aware
        routing has a use for it."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()

    def _rank_healthy(self, prompt_ids, replicas):
        ids = sorted(r.replica_id for r in replicas)
        start = next(self._turn) % len(ids)
        return ids[start:] + ids[:start]


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def _rank_healthy(self, prompt_ids, replicas):
        return self.by_load(replicas)


def prefix_hashes(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per whole block of the prompt, each covering every token before it too. The same in every
    process of one Python build (the hash of an int, and so of a tuple of ints, is not salted per
    process like a str's), so a replica can name its cached prefixes in the router's terms."""
    hashes, h = [], 0
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        h = hash((h, tuple(prompt_ids[start:start + block_size])))
        hashes.append(h)
    return hashes


class PrefixAware(RoutingPolicy):
    name = "prefix-aware"

    def __init__(self, block_size: int = 16, blocks_per_replica: int = 4096, cache_threshold: float = 0.5,
                 balance_abs_threshold: int = 8, balance_rel_threshold: float = 1.5) -> None:
        super().__init__()
        if block_size < 1 or blocks_per_replica < 1:
            raise ValueError(f"block_size and blocks_per_replica must be at least 1, got {block_size}, "
                             f"{blocks_per_replica}")
        self.block_size = block_size
        self.blocks_per_replica = blocks_per_replica
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cached: dict[str, OrderedDict[int, None]] = {}  # replica -> prefix hashes, oldest first

    def matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        cached = self.cached.get(replica_id, {})
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n

    def _imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        loads = [self.in_flight.get(r.replica_id, 0) for r in replicas]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _rank_healthy(self, prompt_ids, replicas):
        by_load = self.by_load(replicas)
        hashes = prefix_hashes(prompt_ids, self.block_size)
        if not hashes or self._imbalanced(replicas):
            return by_load
        matched = {r.replica_id: self.matched_blocks(r.replica_id, hashes) for r in replicas}
        best = max(by_load, key=lambda rid: matched[rid])  # by_load order breaks ties
        if matched[best] / len(hashes) >= self.cache_threshold:
            return [best, *(rid for rid in by_load if rid != best)]
        # No replica holds enough of it: the one caching least, so distinct prefixes spread out.
        return sorted(by_load, key=lambda rid: len(self.cached.get(rid, ())))

    def placed(self, replica_id: str, prompt_ids: Sequence[int]) -> None:
        cached = self.cached.setdefault(replica_id, OrderedDict())
        for h in prefix_hashes(prompt_ids, self.block_size):
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.blocks_per_replica:
            cached.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        super().forget(replica_id)
        self.cached.pop(replica_id, None)

    def cache_reported(self, replica_id: str, hashes: Sequence[int]) -> None:
        """Merged in as older than anything this router sent the replica itself: a report is up to a
        couple of seconds old and names only what the replica had computed by then, so where the picture
        is full, what this router routed since wins and the report fills the room left (its oldest
        dropped first; a replica lists a prefix's tail before the blocks it hangs from, prefix_summary.py)."""
        cached = self.cached.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):  # each to the old end, newest first: the report's order is kept
            if h not in cached:
                cached[h] = None
                cached.move_to_end(h, last=False)
        while len(cached) > self.blocks_per_replica:
            cached.popitem(last=False)


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    """A policy by its flag name; prefix-aware takes block_size, blocks_per_replica and thresholds."""
    if name == "prefix-aware":
        return PrefixAware(**kwargs)
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"routing_policy: {name!r} is not one of {', '.join(POLICIES)}")
