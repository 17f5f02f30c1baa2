"""The draft-model proposer: a smaller model with the target's tokenizer guesses each decoding
sequence's next tokens, greedily, over a paged KV cache of its own (speculation.py decides how many).

Each sequence that drafts has a mirror here: a `Sequence` over the same tokens whose KV the draft model
holds. A proposal of k tokens first feeds the mirror what the target wrote since the last one (the
whole prompt the first time, `max_catch_up` tokens a step) and samples the first draft from its last
row, then feeds each draft to get the next: k forwards, every drafting mirror's row in each. Drafts
the target rejected are forgotten the way the target forgets its own: the mirror's computed count moves
back to the longest prefix it shares with the sequence, and the blocks past it are released.

Greedy drafts are a one-hot proposal q, so the target's verification (model/sampler.py) is exact for
every sampling setting, and a seeded request writes the same tokens with or without a draft model.
(Sampling drafts from the draft's own distribution would be accepted more often at high temperature,
at the price of a second random stream; not done.)
"""

from __future__ import annotations

import logging
import time

from ..model.decoder import DecoderModel
from ..model.kv_layout import KVLayout
from ..runner import ModelRunner
from ..sampling_params import SamplingParams
from ..step import Sequence, StepPlan
from .kv_cache import KVCacheManager
from .speculation import StepCost

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, size_ratio: float = 1.0,
                 max_catch_up: int = 256):
        """`num_blocks`: the draft's own KV pool (the target's block count: any sequence the target holds
        fits). `size_ratio`: its weights' bytes over the target's (a round's price before one is timed).
        `max_catch_up`: the most tokens a mirror is fed in one step (a long prompt's catch-up is
        spread over steps, as a chunked prefill is)."""
        self.model = model
        groups = KVLayout.of(model.config).num_groups
        num_blocks *= groups  # each KV group's tables may hold as many blocks as the target's pool
        self.runner = ModelRunner(model, num_blocks, block_size)
        # A mirror's computed count moves back past rejected drafts (`trim`), behind blocks a sliding
        # window would have released: its tables keep every block.
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, windows=(None,) * groups)
        self.size_ratio = size_ratio
        self.cost = StepCost(prior_ratio=0.05)  # a round's time: d0 + d1 * tokens fed, measured
        self.max_catch_up = max_catch_up
        self.mirrors: dict[str, Sequence] = {}  # sequence id -> its mirror
        self.own: dict[str, int] = {}  # sequence id -> how many of its mirror's first tokens are the sequence's

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        """Up to `depths[i]` greedy drafts for `seqs[i]` (fewer where the draft's KV pool is full, none
        while a mirror is still catching up on a long prompt)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        rows: list[tuple[int, Sequence, int]] = []  # (index, mirror, tokens fed this round)
        catching_up: list[tuple[Sequence, int]] = []
        for i, (seq, depth) in enumerate(zip(seqs, depths, strict=True)):
            if depth > 0:
                mirror = self._sync(seq)
                behind = mirror.num_tokens - mirror.num_computed_tokens
                if behind > self.max_catch_up:
                    catching_up.append((mirror, self.max_catch_up))
                else:
                    rows.append((i, mirror, behind))
        while rows or catching_up:
            plan = StepPlan()
            for _, mirror, n in rows:
                if self._allocate(mirror, n, seqs):
                    plan.scheduled.append((mirror, n))
            for mirror, n in catching_up:
                if self._allocate(mirror, n, seqs):
                    plan.scheduled.append((mirror, n))
            if plan.is_empty:
                break
            start = time.perf_counter()
            results = self.runner.execute(plan)
            self.cost.observe(plan.num_batched_tokens, time.perf_counter() - start)  # the draft's cost line
            catching_up = []
            for res in results:
                res.seq.num_computed_tokens += res.num_tokens
            by_mirror = {id(res.seq): res.token_id for res in results}
            next_rows = []
            for i, mirror, _ in rows:
                token = by_mirror.get(id(mirror))
                if token is None or isinstance(token, BaseException):
                    continue  # not fed (no free blocks) or not sampled: this sequence drafts no further
                drafts[i].append(token)
                mirror.token_ids.append(token)
                if len(drafts[i]) < depths[i]:
                    next_rows.append((i, mirror, 1))
            rows = next_rows
        return drafts

    def lag(self, seq: Sequence) -> int:
        """How many of `seq`'s tokens the draft model must be fed before it drafts (no mirror yet: all)."""
        mirror = self.mirrors.get(seq.seq_id)
        return seq.num_tokens - (self._shared(seq, mirror) if mirror is not None else 0)

    def _shared(self, seq: Sequence, mirror: Sequence) -> int:
        """How many of the mirror's computed tokens are the sequence's: its first `own` tokens were, then
        come drafts, kept up to the first the sequence did not write (at least the last token is fed
        again: its row is the one that drafts)."""
        shared = self.own[seq.seq_id]
        end = min(mirror.num_computed_tokens, seq.num_tokens)
        while shared < end and mirror.token_ids[shared] == seq.token_ids[shared]:
            shared += 1
        return min(shared, mirror.num_computed_tokens, seq.num_tokens - 1)

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of `seq`, holding its tokens, computed up to the longest prefix the two share."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence(seq.request_id, seq.index, seq.prompt_token_ids, GREEDY)
            self.own[seq.seq_id] = mirror.num_tokens
        shared = self._shared(seq, mirror)
        mirror.token_ids = list(seq.token_ids)
        self.own[seq.seq_id] = seq.num_tokens
        if shared < mirror.num_computed_tokens:
            mirror.num_computed_tokens = shared
            self.kv.trim(mirror, shared)
        return mirror

    def _allocate(self, mirror: Sequence, n: int, keep: list[Sequence]) -> bool:
        """Blocks for `n` more tokens; when the pool is full, mirrors of sequences not drafting this step
        are dropped first (they catch up again when they next draft)."""
        if self.kv.allocate_slots(mirror, n):
            return True
        drafting = {seq.seq_id for seq in keep}
        for seq_id in [s for s in self.mirrors if s not in drafting]:
            self.kv.free(self.mirrors.pop(seq_id))
            del self.own[seq_id]
        return self.kv.allocate_slots(mirror, n)

    def forget(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: its mirror's blocks go back to the pool."""
        mirror = self.mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.kv.free(mirror)
            del self.own[seq.seq_id]
