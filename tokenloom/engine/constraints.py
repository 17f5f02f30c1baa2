"""What a request's sequences may sample: logit bias, allowed ids, bad words and a grammar.

`RequestConstraints` is built once per request and shared by its `n` sequences: the allowed ids as
one mask over the vocabulary, the logit bias as tensors (`token_sets.py`), the bad words as one
automaton, the grammar compiled once (each sequence copies it). Its ids were checked against the
vocabulary by `request_checks`. Each step it gives the `RowConstraint` of a row that samples, at a
cost that does not grow with the size of those lists; the sampler applies it. After a token is
chosen the grammar and the bad-word automaton consume it, and the tokens the grammar then admits as
the only continuation are appended without a forward each (jump-forward): the next step computes
their KV as one chunk.
"""

from __future__ import annotations

from ..model.tokenizer import TokenizerWrapper
from ..sampling_params import SamplingParams
from ..step import RowConstraint, Sequence
from ..structured_output.grammar import FixedMask, GrammarCompiler, GrammarState
from ..token_sets import TokenBias, TokenSet


class RequestConstraints:
    def __init__(self, params: SamplingParams, tokenizer: TokenizerWrapper, grammars: GrammarCompiler | None,
                 vocab_size: int):
        self.params = params
        self.allowed = TokenSet(params.allowed_token_ids, vocab_size) if params.allowed_token_ids else None
        self.logit_bias = TokenBias(params.logit_bias) if params.logit_bias else None
        self.bad_words = BadWords(_bad_word_ids(params.bad_words or [], tokenizer))
        self.bad_word_states = [0] * params.n  # each sequence's place in the bad-word automaton
        self.grammars: list[GrammarState] = []
        self.lookahead: list[list[FixedMask]] = [[] for _ in range(params.n)]  # per sequence, after its drafts
        if params.structured_outputs is not None:
            self.grammars = [grammars.matcher(params.structured_outputs) for _ in range(params.n)]

    @classmethod
    def of(cls, params: SamplingParams, tokenizer, grammars, vocab_size: int) -> RequestConstraints | None:
        """None for a request that constrains nothing (the common case costs nothing per step)."""
        p = params
        if not (p.logit_bias or p.allowed_token_ids or p.bad_words or p.structured_outputs):
            return None
        return cls(params, tokenizer, grammars, vocab_size)

    def rows(self, seq: Sequence, banned: list[tuple[int, ...]]) -> list[RowConstraint]:
        """The constraint of each row the sequence samples: after its last token, then after each of its
        drafts (`banned[i]`: the engine's bans at row i)."""
        drafts, state = seq.spec_token_ids, self.bad_word_states[seq.index]
        grammars = [self.grammars[seq.index], *self.lookahead[seq.index][: len(drafts)]] if self.grammars else [None]
        out = []
        for i in range(len(drafts) + 1):
            out.append(RowConstraint(banned[i] + self.bad_words.banned[state], self.logit_bias, self.allowed,
                                     grammars[i] if i < len(grammars) else None))
            if i < len(drafts) and len(self.bad_words.children) > 1:
                state = self.bad_words.advance(state, drafts[i])
        return out

    def fit_drafts(self, seq: Sequence) -> None:
        """Cut the sequence's drafts to those its grammar admits and compute the masks after them."""
        if self.grammars and seq.spec_token_ids:
            masks = self.grammars[seq.index].lookahead(seq.spec_token_ids)
            del seq.spec_token_ids[len(masks):]
            self.lookahead[seq.index] = [FixedMask(m) for m in masks]

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance the sequence's bad-word state and grammar; False when the grammar is complete.
        Raises GrammarError when the grammar failed (the request ends with an error)."""
        if len(self.bad_words.children) > 1:  # words of one token need no state
            self.bad_word_states[seq.index] = self.bad_words.advance(self.bad_word_states[seq.index], token)
        if not self.grammars:
            return True
        grammar = self.grammars[seq.index]
        return grammar.accept(token) and not grammar.finished

    def forced_tokens(self, seq: Sequence) -> list[int]:
        if not self.grammars or seq.params.logprobs is not None:  # forced tokens have no logprobs to report
            return []
        return self.grammars[seq.index].forced_tokens()


class BadWords:
    """The bad words' token sequences as one Aho-Corasick automaton over token ids.

    A sequence's state is the longest suffix of its output that begins some word; `banned[state]` are
    the last tokens of every word whose other tokens the output ends with. Advancing costs O(1)
    amortised per token and a row's bans are one lookup, whatever the number and length of the words
    (the per-step scan of every word over the output tail cost seconds with 1,024 long words, n=64)."""

    def __init__(self, words: list[list[int]]):
        self.children: list[dict[int, int]] = [{}]
        ends: list[set[int]] = [set()]  # per state: last tokens of the words whose prefix is that state
        for word in words:
            state = 0
            for token in word[:-1]:
                nxt = self.children[state].get(token)
                if nxt is None:
                    nxt = self.children[state][token] = len(self.children)
                    self.children.append({})
                    ends.append(set())
                state = nxt
            ends[state].add(word[-1])
        self.fail = [0] * len(self.children)
        order = list(self.children[0].values())  # breadth first: a state's fail link is set before its children's
        for state in order:
            for token, child in self.children[state].items():
                self.fail[child] = self._step(self.fail[state], token) if state else 0
                order.append(child)
        self.banned: list[tuple[int, ...]] = [()] * len(self.children)
        self.banned[0] = tuple(sorted(ends[0]))
        for state in order:  # the words ending at a state's suffixes are banned there too
            self.banned[state] = tuple(sorted(ends[state] | set(self.banned[self.fail[state]])))

    def _step(self, state: int, token: int) -> int:
        while True:
            nxt = self.children[state].get(token)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self.fail[state]

    def advance(self, state: int, token: int) -> int:
        return self._step(state, token)


def _bad_word_ids(words: list[str], tokenizer: TokenizerWrapper) -> list[list[int]]:
    """Each word as the model would write it alone and after a space (vLLM's convention)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)  # no BOS
            if ids:
                out[ids] = None
    return [list(ids) for ids in out]
