"""Structured outputs: grammars that constrain sampling, compiled once and shared by text.

A request asks for one of vLLM's `structured_outputs` kinds (a JSON schema, any JSON object, a regex,
a choice among strings, or a grammar in EBNF/GBNF or Lark); OpenAI's `response_format` and tool
calls are mapped onto them by the server. `GrammarCompiler` turns the request into an llguidance
grammar, checks it against the model's tokenizer and caches the compiled matcher by the grammar's
text, so a second request with the same schema compiles nothing: it gets a copy of the cached
matcher (microseconds). Each constrained sequence owns one matcher, which fills the row's token
bitmask before sampling, consumes the sampled token after it, and says which tokens are forced
next (jump-forward).

Generated JSON is compact (no whitespace between the tokens of the JSON syntax, as vLLM's
`disable_any_whitespace`): a small model cannot loop on blank lines, and fixed keys and punctuation
become forced tokens that jump-forward appends without a forward each.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import llguidance
import torch

_JSON_OPTIONS = {"whitespace_flexible": False}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set (vLLM's names)."""

    json: str | dict | None = None  # a JSON schema, as an object or its text
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF/GBNF (`root ::= ...`) or Lark (`start: ...`)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs: set exactly one of {', '.join(_KINDS)} (got {', '.join(chosen) or 'none'})"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json: a JSON schema must be an object")
            # Canonical text (keys keep their order: properties are generated in the schema's order),
            # so the same schema sent as an object or as text, spaced any way, compiles once.
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_llguidance(self) -> str:
        """The llguidance grammar text; raises ValueError naming the field when it cannot be built."""
        kind = self.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.json, overrides=_JSON_OPTIONS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", list(self.choice))
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None


class GrammarCompiler:
    """Compiles grammars against one tokenizer; thread-safe; an LRU cache keyed by the grammar text."""

    def __init__(self, tokenizer, vocab_size: int, max_cached: int = 256):
        self._tokenizer_json = tokenizer.tokenizer.to_str()
        self._eos = list(tokenizer.eos_token_ids)
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:  # ~0.3 s: built on first use, not at start-up
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The cached template matcher for `params`; compiles on a miss. Call off the engine thread."""
        grammar = params.to_llguidance()
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(matcher.get_error())}")
        with self._lock:
            self.num_compiled += 1
            self._cache[grammar] = matcher
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh per-sequence state (a copy of the cached matcher)."""
        return GrammarState(self.compile(params).deep_copy(), self._vocab_size)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 words, bit i of word w = token 32w+i)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.numel() == bitmask_words(self.vocab_size)
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar admits as the only continuation (jump-forward); [] when there is a choice."""
        return self.matcher.compute_ff_tokens()

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size]: True where a token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
