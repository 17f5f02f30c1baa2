"""Batched sampling with per-request parameters.

Order of operations per row (as vLLM): penalties (repetition on prompt+output, presence/frequency
on output), then the row's constraint from the plan (logit bias, allowed ids, banned ids such as stop
tokens under `min_tokens`, a grammar's bitmask) act on the logits; greedy rows take the argmax; the other rows divide by temperature, keep top-k / top-p / min-p, and draw with the exponential race
(argmax of p / Exp(1)) from the row's own generator, so a seeded request draws the same numbers
whatever else is in the batch. Logprobs are those of the raw model output, before any processing.
A sequence with speculative drafts has a row per draft more; `Sampler.__call__` says how they are verified.

Fault isolation: if the batch raises, each sequence is sampled alone; one that still raises gets its
exception in place of its tokens (and no logprobs), so the engine fails that request and no other.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np
import torch

from .. import faults
from ..outputs import TokenLogprobs
from ..sampling_params import SamplingParams
from ..step import RowConstraint
from ..structured_output.grammar import bitmask_words, unpack_bitmask
from ..token_sets import allowed_mask, bias_tensors
from . import vocab_select


def verify(drafts: Seq[int], tokens: Iterable[int]) -> list[int]:
    """What a sequence emits from its rows' tokens, taken in order (lazily: a draw happens only for a row
    that is reached): each row's token, for as long as it equals the draft that row's successor
    assumed; the first token that differs, or the one after the last draft, ends the walk."""
    emitted: list[int] = []
    for i, token in enumerate(tokens):
        emitted.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return emitted


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int]) -> None:
    """In place on one row."""
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Mask to -inf what top-k (0 = off), top-p (1 = off) and min-p (0 = off) exclude; rows in place."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(logits.shape[-1]).expand_as(probs)
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
    drop = ranks >= k
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)  # keep the smallest set reaching top_p
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def apply_constraints(logits: torch.Tensor, constraints: Seq[RowConstraint | None], raw: torch.Tensor) -> None:
    """In place, per row: logit bias, allowed ids, banned ids, then the grammar's bitmask (all rows with a
    grammar in one unpack). A row left with no finite logit (say `min_tokens` bans the end-of-sequence
    token a finished grammar demands) falls back to the grammar's mask alone: the grammar wins; without a
    grammar, to the row's allowed ids (or to no constraint)."""
    if not any(constraints):
        return
    grammar_rows = []
    for r, c in enumerate(constraints):
        if c is None:
            continue
        if c.logit_bias:  # the engine's TokenBias / TokenSet carry their tensors, built once per request
            ids, values = bias_tensors(c.logit_bias, logits.dtype)
            logits[r, ids] += values
        if c.allowed_ids is not None:
            logits[r].masked_fill_(~allowed_mask(c.allowed_ids, logits.shape[-1]), float("-inf"))
        if c.banned_ids:
            logits[r, list(c.banned_ids)] = float("-inf")
        if c.grammar is not None:
            grammar_rows.append(r)
    if grammar_rows:
        vocab = logits.shape[-1]
        words = torch.zeros(len(grammar_rows), bitmask_words(vocab), dtype=torch.int32)
        for j, r in enumerate(grammar_rows):
            constraints[r].grammar.fill_bitmask(words[j])
        rows = torch.tensor(grammar_rows)
        allowed = unpack_bitmask(words, vocab)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        dead = ~logits[rows].isfinite().any(dim=-1)
        if dead.any():
            logits[rows[dead]] = raw[rows[dead]].masked_fill(~allowed[dead], float("-inf"))
    for r in (~logits.isfinite().any(dim=-1)).nonzero().flatten().tolist():
        # Banned ids (min_tokens, bad words) left nothing: the request's own allowed ids win over them.
        c = constraints[r]
        logits[r] = raw[r]
        if c is not None and c.allowed_ids is not None:
            logits[r].masked_fill_(~allowed_mask(c.allowed_ids, raw.shape[-1]), float("-inf"))


def top_logprobs(logprobs_row: torch.Tensor, chosen: int, n: int) -> TokenLogprobs:
    out: TokenLogprobs = {}
    if n > 0:
        values, ids = logprobs_row.topk(n)
        out = dict(zip(ids.tolist(), values.tolist(), strict=True))
    out.setdefault(chosen, float(logprobs_row[chosen]))
    return out


def choice_generator(seed: int, choice: int) -> np.random.Generator:
    """The random stream of choice `choice` of a request seeded with `seed` (any 64-bit integer).
    torch's CPU generator keeps only the low 32 bits of a seed, and seeding choice i with seed + i made
    choice 1 of seed s replay choice 0 of seed s + 1; numpy's SeedSequence hashes all 64 bits and the
    choice index (as a spawn key) into a PCG64 state, so every (seed, choice) gets its own stream."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed & (2**64 - 1), spawn_key=(choice,))))


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = np.random.default_rng(seed)  # unseeded choices share this stream

    def __call__(
        self,
        logits: torch.Tensor,  # [rows, V] float32: per sampling sequence, 1 + len(its drafts) consecutive rows
        params: list[SamplingParams],
        prompt_ids: list[Seq[int]],
        output_ids: list[Seq[int]],
        generators: list[np.random.Generator | None],  # seeded choices (choice_generator)
        constraints: list[list[RowConstraint | None]],  # per sequence, one per row (position)
        drafts: list[list[int]] | None = None,  # speculative tokens the rows after the first verify
    ) -> tuple[list[list[int] | Exception], list[list[TokenLogprobs | None]]]:
        """Per sequence: the tokens it emits (the accepted drafts, then one sampled token) and their
        logprobs. A sequence's row i is the model's output after its drafts [0, i); the token sampled
        there is drawn exactly as without speculation (same processing, and for a seeded request the
        same next numbers of its stream), and the walk goes on to row i+1 only while that token equals
        draft i. So a draft is accepted with probability p(draft) and otherwise the token comes from p
        without it: rejection sampling against a proposal that is one token for sure (Leviathan et al.
        2023 with q one-hot), and a seeded request writes the same tokens with or without drafts."""
        drafts = drafts if drafts is not None else [[] for _ in params]
        spans = np.cumsum([0] + [len(d) + 1 for d in drafts])
        args = (params, prompt_ids, output_ids, generators, constraints, drafts)
        try:
            return self._sample(logits, spans, *args)
        except Exception:  # noqa: BLE001 - find the sequence(s) at fault, sample the others alone
            chosen: list[list[int] | Exception] = []
            logprobs: list[list[TokenLogprobs | None]] = []
            for s in range(len(params)):
                try:
                    tok, lp = self._sample(logits[spans[s] : spans[s + 1]], spans[s : s + 2] - spans[s],
                                           *(a[s : s + 1] for a in args))
                    chosen.append(tok[0])
                    logprobs.append(lp[0])
                except Exception as exc:  # noqa: BLE001 - handed to the engine in place of the tokens
                    chosen.append(exc)
                    logprobs.append([])
            return chosen, logprobs

    def take_argmax(self, argmaxes: list[list[int]], drafts: list[list[int]],
                    prompt_ids: list[Seq[int]]) -> list[list[int] | Exception]:
        """Per greedy sequence whose rows' argmax the LM head found without logits (runner.argmax_only):
        the tokens it emits, its drafts verified against those argmaxes as `__call__` verifies them, or
        its own fault (the fault-injection hook) in place of its tokens."""
        taken: list[list[int] | Exception] = []
        for tokens, draft, ids in zip(argmaxes, drafts, prompt_ids, strict=True):
            try:
                if faults.ACTIVE:
                    faults.maybe_raise_for_prompt("sampler", ids)
                taken.append(verify(draft, tokens))
            except Exception as exc:  # noqa: BLE001 - handed to the engine in place of the tokens
                taken.append(exc)
        return taken

    def _sample(self, logits, spans, params, prompt_ids, output_ids, generators, constraints, drafts):
        if faults.ACTIVE:
            for ids in prompt_ids:
                faults.maybe_raise_for_prompt("sampler", ids)
        seq_of = np.repeat(np.arange(len(params)), np.diff(spans))  # row -> sequence
        pos_of = np.arange(len(seq_of)) - spans[seq_of]  # row -> its position after the sequence's tokens
        row_params = [params[s] for s in seq_of]
        row_constraints = [constraints[s][i] for s, i in zip(seq_of, pos_of, strict=True)]
        raw = logits
        penalised = [r for r, p in enumerate(row_params) if p.penalised]
        if penalised or any(row_constraints):  # edited in place below; `raw` keeps the model's for logprobs
            logits = logits.clone()
            for r in penalised:
                s, i = seq_of[r], pos_of[r]
                history = output_ids[s] if i == 0 else [*output_ids[s], *drafts[s][:i]]
                apply_penalties(logits[r], row_params[r], prompt_ids[s], history)
            apply_constraints(logits, row_constraints, raw)

        random_rows = [r for r, p in enumerate(row_params) if not p.greedy]
        greedy_rows = [r for r, p in enumerate(row_params) if p.greedy]
        greedy_tokens: dict[int, int] = {}
        if greedy_rows:  # a row's argmax is its own, so only the greedy rows are scanned
            greedy = logits if len(greedy_rows) == len(row_params) else logits[greedy_rows]
            greedy_tokens = dict(zip(greedy_rows, vocab_select.argmax(greedy).tolist(), strict=True))
        probs_of: dict[int, torch.Tensor] = {}
        if random_rows:
            rows = torch.tensor(random_rows)
            sub = logits[rows] / torch.tensor([row_params[r].temperature for r in random_rows]).unsqueeze(1)
            if any(row_params[r].top_k > 0 or row_params[r].top_p < 1 or row_params[r].min_p > 0 for r in random_rows):
                sub = filter_top_k_top_p_min_p(
                    sub,
                    torch.tensor([row_params[r].top_k for r in random_rows]),
                    torch.tensor([row_params[r].top_p for r in random_rows], dtype=sub.dtype),
                    torch.tensor([row_params[r].min_p for r in random_rows], dtype=sub.dtype),
                )
            probs_of = dict(zip(random_rows, sub.softmax(dim=-1), strict=True))

        chosen = [verify(drafts[s], (greedy_tokens[r] if p.greedy else self._draw(probs_of[r], generators[s])
                                     for r in range(spans[s], spans[s + 1])))
                  for s, p in enumerate(params)]

        logprobs: list[list[TokenLogprobs | None]] = [[None] * len(e) for e in chosen]
        wanted = [(s, i) for s, p in enumerate(params) if p.logprobs is not None for i in range(len(chosen[s]))]
        if wanted:
            lp = raw[[spans[s] + i for s, i in wanted]].log_softmax(dim=-1)
            for j, (s, i) in enumerate(wanted):
                logprobs[s][i] = top_logprobs(lp[j], chosen[s][i], params[s].logprobs)
        return chosen, logprobs

    def _draw(self, probs: torch.Tensor, generator: np.random.Generator | None) -> int:
        """The exponential race (argmax of p / Exp(1)): a draw from `probs` with one vector of noise, from
        the request's own stream when seeded (see choice_generator), so a seeded choice draws the same
        whatever else is in the batch. numpy's exponentials (a ziggurat): ~5 ns each where torch's
        `exponential_` takes ~25, which made the noise most of a sampled row's cost on a 49k vocabulary."""
        stream = self.default_generator if generator is None else generator
        noise = torch.from_numpy(stream.standard_exponential(probs.shape[0], dtype=np.float32))
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # an Exp(1) draw of 0 would divide by zero
        return int((probs / noise).argmax())
