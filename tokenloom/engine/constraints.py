"""What a request's sequences may sample: logit bias, allowed ids, bad words and a grammar.

`RequestConstraints` is built once per request (bad words tokenized, one grammar state per
sequence; its ids were checked against the vocabulary by `request_checks`) and asked each step for the `RowConstraint` of a row
that samples; the sampler applies it. After a token is chosen the grammar consumes it, and the
tokens the grammar then admits as the only continuation are appended without a forward each
(jump-forward): the next step computes their KV as one chunk.
"""

from __future__ import annotations

from ..model.tokenizer import TokenizerWrapper
from ..sampling_params import SamplingParams
from ..step import RowConstraint, Sequence
from ..structured_outputs import GrammarCompiler, GrammarState


class RequestConstraints:
    def __init__(self, params: SamplingParams, tokenizer: TokenizerWrapper, grammars: GrammarCompiler | None):
        self.params = params
        self.allowed = tuple(params.allowed_token_ids) if params.allowed_token_ids else None
        self.bad_words = _bad_word_ids(params.bad_words or [], tokenizer)
        self.grammars: list[GrammarState] = []
        if params.structured_outputs is not None:
            self.grammars = [grammars.matcher(params.structured_outputs) for _ in range(params.n)]

    @classmethod
    def of(cls, params: SamplingParams, tokenizer, grammars) -> RequestConstraints | None:
        """None for a request that constrains nothing (the common case costs nothing per step)."""
        p = params
        if not (p.logit_bias or p.allowed_token_ids or p.bad_words or p.structured_outputs):
            return None
        return cls(params, tokenizer, grammars)

    def row(self, seq: Sequence, banned: tuple[int, ...]) -> RowConstraint:
        output = seq.output_token_ids
        for word in self.bad_words:
            if len(word) == 1 or (len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == word[:-1]):
                banned += (word[-1],)
        grammar = self.grammars[seq.index] if self.grammars else None
        return RowConstraint(banned, self.params.logit_bias, self.allowed, grammar)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance the sequence's grammar; False when the token breaks it (or the grammar is complete)."""
        if not self.grammars:
            return True
        grammar = self.grammars[seq.index]
        return grammar.accept(token) and not grammar.finished

    def forced_tokens(self, seq: Sequence) -> list[int]:
        if not self.grammars or seq.params.logprobs is not None:  # forced tokens have no logprobs to report
            return []
        return self.grammars[seq.index].forced_tokens()


def _bad_word_ids(words: list[str], tokenizer: TokenizerWrapper) -> list[list[int]]:
    """Each word as the model would write it alone and after a space (vLLM's convention)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # no BOS
            if ids and ids not in out:
                out.append(ids)
    return out
