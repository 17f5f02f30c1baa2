"""Speculative decoding: which draft tokens each decoding sequence brings to a step.

Each step, before the scheduler runs, every running sequence that decodes asks the proposer for up to
`num_speculative_tokens` drafts; the policy keeps the ones worth their cost; the scheduler fits them
into the token budget as extra tokens of the sequence's row; the forward scores them with everyone
else's rows; the sampler verifies them (model/sampler.py: exact, a seeded request writes the same
tokens either way); the engine appends what was accepted and releases blocks only drafts used.

- `NgramProposer` is prompt lookup (vLLM's `ngram` method): find the longest n-gram (n from
  `prompt_lookup_max` down to `prompt_lookup_min`) ending the sequence that occurred before in its
  prompt or output, most recent occurrence first, and propose the tokens that followed it.
- A draft model (engine/draft_model.py, vLLM's `draft_model` method) proposes greedily what a smaller
  model with the same tokenizer writes next; the policy chooses first how deep it drafts, because
  each depth costs a forward of the draft model (`_draft_depths`).
- `SpeculationPolicy` is what makes speculation never a loss. A draft at depth i of a sequence is
  accepted with probability about a^i, `a` the sequence's measured acceptance rate; a step of R rows
  costs about c0 + c1 R, fitted to the measured times of decode steps. Rows are added in order of
  their expected tokens while a row adds more expected tokens than the step's average per unit of
  time: at batch 1 (c1 << c0) a fair match is worth proposing; at 32 busy streams (a row costs about
  the step's average token) only drafts that are almost sure to be accepted are.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from ..config import SpeculativeConfig
from ..step import Sequence


class NgramProposer:
    """Prompt lookup over a sequence's last `window` tokens (its prompt and output)."""

    def __init__(self, config: SpeculativeConfig, window: int = 4096):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.window = window

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the sequence's last n tokens."""
        tokens = np.asarray(token_ids[-self.window :], dtype=np.int64)
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])  # earlier places the last token occurred
        if k <= 0 or ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # how many tokens up to each place match the tail
        for j in range(1, min(self.n_max, last)):
            alive = (length == j) & (ends >= j)
            if not alive.any():
                break
            length[alive] += tokens[ends[alive] - j] == tokens[last - j]
        best = length.max()
        if best < self.n_min:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest matches
        # What followed the match; where that runs into the tail, the tail repeats with the match's period.
        follow = tokens[end + 1 :].tolist()
        period = last - end
        return [follow[i] if i < len(follow) else follow[i % period] for i in range(k)]


class StepCost:
    """A step's time as c0 + c1 * rows, fitted by exponentially weighted least squares to decode
    steps, and pulled toward `prior_ratio` = c1 / c0 while the rows seen vary too little to tell."""

    def __init__(self, prior_ratio: float = 0.05, decay: float = 0.98, ridge: float = 0.25):
        self.prior_ratio, self.decay, self.ridge = prior_ratio, decay, ridge
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    @property
    def measured(self) -> bool:
        return self.w > 0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1) in seconds; (1, prior_ratio) before any step was seen (only their ratio matters)."""
        if self.w == 0:
            return 1.0, self.prior_ratio
        mx, my = self.x / self.w, self.y / self.w
        var, cov = self.xx / self.w - mx * mx, self.xy / self.w - mx * my
        prior_c1 = self.prior_ratio * my / (1 + self.prior_ratio * mx)
        c1 = max((cov + self.ridge * prior_c1) / (max(var, 0.0) + self.ridge), 0.0)
        c0 = max(my - c1 * mx, 0.1 * my)  # a step never costs nothing
        return c0, c1


# How far a sequence's acceptance estimate moves back toward the prior in each step it drafts nothing.
# A rate is only measured on drafts, and a sequence whose rate fell below what a draft row costs would
# never draft again: on the grounded prompts (answers copying their input) about a fifth of all steps
# skipped the lookup that way. At 0.05 a sequence that missed four times in a row tries one or two
# drafts again about 8 steps later.
RELAX = 0.05


@dataclass
class Acceptance:
    """A sequence's per-draft acceptance rate: accepted / (accepted + rejections), decayed, from a prior."""

    accepted: float = 1.0
    trials: float = 2.0  # the prior: 1 in 2

    def observe(self, proposed: int, accepted: int, decay: float = 0.9) -> None:
        self.accepted = decay * self.accepted + accepted
        self.trials = decay * self.trials + accepted + (accepted < proposed)

    def relax(self, toward: Acceptance, weight: float = RELAX) -> None:
        """A step without drafts: a little of the way back to `toward` (what a new sequence is priced at)."""
        self.accepted += weight * (toward.accepted - self.accepted)
        self.trials += weight * (toward.trials - self.trials)

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


@dataclass
class SpecDecodeStats:
    """Totals since start, with vLLM's meaning (read by the metrics, the lab and the trace)."""

    num_drafts: int = 0  # rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts at depth i accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts at depth i proposed

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.drafted_per_pos) < proposed:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(proposed):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Drafter(Protocol):
    """What the policy asks of a draft model's proposer (engine/draft_model.py's `DraftModelProposer`)."""

    size_ratio: float  # its weights' bytes over the target's
    cost: StepCost  # a round's time against the tokens it feeds

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]: ...

    def lag(self, seq: Sequence) -> int: ...

    def forget(self, seq: Sequence) -> None: ...


class SpeculationPolicy:
    """Proposes drafts for the step's decoding sequences and keeps those worth their rows."""

    def __init__(self, config: SpeculativeConfig, draft: Drafter | None = None):
        """`draft`: the draft model's proposer (engine/draft_model.py) for method "draft_model"."""
        self.config = config
        self.proposer = NgramProposer(config)
        self.draft = draft
        self.propose_seconds = 0.0  # the draft model's time in this step
        self.cost = StepCost()
        self.acceptance: dict[str, Acceptance] = {}
        self.overall = Acceptance()  # every sequence's verifications, decayed
        self.stats = SpecDecodeStats()

    def propose(self, seqs: list[Sequence], limits: list[int]) -> None:
        """Set each sequence's `spec_token_ids` for this step; `limits[i]`: the most drafts sequence i may
        take (what its `max_tokens`, the context length and its grammar leave)."""
        if self.draft is not None:
            start = time.perf_counter()
            drafts = self.draft.propose(seqs, self._draft_depths(seqs, limits))
            for seq, d in zip(seqs, drafts, strict=True):
                seq.spec_token_ids = d
            self.propose_seconds = time.perf_counter() - start
        elif self.config.adaptive and not self._any_worth(seqs):
            for seq in seqs:
                seq.spec_token_ids = []
        else:
            k = self.config.num_speculative_tokens
            drafts = [self.proposer.propose(s.token_ids, min(k, lim)) for s, lim in zip(seqs, limits, strict=True)]
            keep = [len(d) for d in drafts] if not self.config.adaptive else self._worth(seqs, drafts)
            for seq, d, n in zip(seqs, drafts, keep, strict=True):
                seq.spec_token_ids = d[:n]
        prior = self._prior()
        for seq in seqs:
            if not seq.spec_token_ids and seq.seq_id in self.acceptance:
                self.acceptance[seq.seq_id].relax(prior)

    def _prior(self) -> Acceptance:
        """What a sequence's first drafts are priced at: 1 in 2 for a lookup; for the draft model, its
        recent rate over all sequences."""
        return Acceptance() if self.draft is None else Acceptance(2 * self.overall.rate, 2.0)

    def _any_worth(self, seqs: list[Sequence]) -> bool:
        """Could the best first draft pay for its row? If not (many busy streams with modest acceptance),
        the step skips looking for drafts at all."""
        c0, c1 = self.cost.coefficients()
        first = self._prior().rate
        best = max((self.acceptance[s.seq_id].rate if s.seq_id in self.acceptance else first for s in seqs),
                   default=0.0)
        return best * (c0 + c1 * len(seqs)) > c1 * len(seqs)

    def _worth(self, seqs: list[Sequence], drafts: list[list[int]]) -> list[int]:
        """Greedy by expected tokens: add the most likely accepted draft row while it adds more tokens per
        second than the step makes on average (E/t grows with a row of value v iff v > c1 * E / t)."""
        c0, c1 = self.cost.coefficients()
        expected, seconds = float(len(seqs)), c0 + c1 * len(seqs)
        rates = [self.acceptance.setdefault(s.seq_id, self._prior()).rate for s in seqs]
        heap = [(-rates[i], i, 1) for i, d in enumerate(drafts) if d]
        heapq.heapify(heap)
        keep = [0] * len(seqs)
        while heap:
            neg_value, i, depth = heapq.heappop(heap)
            value = -neg_value
            if value * seconds <= c1 * expected:
                break
            keep[i] = depth
            expected, seconds = expected + value, seconds + c1
            if depth < len(drafts[i]):
                heapq.heappush(heap, (-value * rates[i], i, depth + 1))
        return keep

    def _draft_depths(self, seqs: list[Sequence], limits: list[int]) -> list[int]:
        """How many tokens each sequence asks the draft model for. Unlike a lookup, a draft costs a round
        of the draft model per depth, so this is chosen before drafting: the m sequences most likely to
        be accepted draft k tokens each, (m, k) maximising expected tokens per second
            E = B + sum_{i<m} sum_{j=1..k} a_i^j,   T = c0 + c1 (B + m k) + k (d0 + d1 m) + sum_{i<m} o_i,
        and nobody drafts where no (m, k) beats the plain step's B / (c0 + c1 B). o_i is what sequence i's
        catch-up costs the draft model (a new sequence's whole prompt), spread over the steps its
        remaining tokens would take: a short answer never pays for drafting after a long prompt."""
        caps = np.array([max(min(self.config.num_speculative_tokens, lim), 0) for lim in limits], dtype=np.int64)
        if not self.config.adaptive or not seqs:
            return caps.tolist()
        c0, c1, d0, d1 = self._draft_costs()
        prior = self._prior()
        rates = np.array([self.acceptance.setdefault(s.seq_id, replace(prior)).rate for s in seqs])
        catch_up = np.array([max(self.draft.lag(s) - 2, 0) for s in seqs]) * d1
        catch_up /= np.maximum(np.asarray(limits, dtype=np.float64) / (1 + rates), 1.0)
        order = np.argsort(-rates, kind="stable")
        depth = np.arange(1, self.config.num_speculative_tokens + 1)[None, :]  # [1, k]
        cap = caps[order][:, None]  # [sequence, 1], most likely first
        within = depth <= cap
        expected = len(seqs) + np.cumsum(np.cumsum(np.where(within, rates[order][:, None] ** depth, 0.0), axis=1), axis=0)
        rows = np.cumsum(np.minimum(depth, cap), axis=0)  # draft rows the first m sequences add at depth k
        drafting = np.cumsum(cap > 0, axis=0)  # sequences in a round (a capped one stops early: an upper bound)
        seconds = (c0 + c1 * (len(seqs) + rows) + depth * (d0 + d1 * drafting)
                   + np.cumsum(np.where(cap > 0, catch_up[order][:, None], 0.0), axis=0))
        m, k = np.unravel_index(np.argmax(expected / seconds), expected.shape)
        if expected[m, k] / seconds[m, k] <= len(seqs) / (c0 + c1 * len(seqs)):
            return [0] * len(seqs)
        depths = [0] * len(seqs)
        for i in order[: m + 1]:
            depths[i] = int(min(k + 1, caps[i]))
        return depths

    def _draft_costs(self) -> tuple[float, float, float, float]:
        """A target step's (c0, c1) per row and a draft round's (d0, d1) per token fed, in seconds. Before
        one of them was timed, it is priced from the other at the models' size ratio."""
        c0, c1 = self.cost.coefficients()
        d0, d1 = self.draft.cost.coefficients()
        ratio = self.draft.size_ratio
        if not self.draft.cost.measured:
            d0, d1 = ratio * c0, ratio * c1
        elif not self.cost.measured:
            c0, c1 = d0 / ratio, d1 / ratio
        return c0, c1, d0, d1

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.acceptance.setdefault(seq.seq_id, self._prior()).observe(proposed, accepted)
        self.overall.observe(proposed, accepted, decay=0.98)
        self.stats.record(proposed, accepted)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step that only decoded (with or without drafts): a point of the cost fit, without the time
        the draft model took (priced on its own: counted in both, drafting would look twice as dear)."""
        seconds -= self.propose_seconds
        self.propose_seconds = 0.0
        if rows > 0 and math.isfinite(seconds) and seconds > 0:
            self.cost.observe(rows, seconds)

    def forget(self, seq: Sequence) -> None:
        self.acceptance.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq)
