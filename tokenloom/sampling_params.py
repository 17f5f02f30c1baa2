"""Per-request generation parameters, with vLLM's field names, normalisation and validation.

Normalisation happens here once, for the offline `LLM` API and the server alike: `stop` may be a
string or a list, `None` stands for a field's default (temperature, top_p, top_k, min_p, the
penalties, stop lists, ...), and top_k 0, -1 or None all mean "off" (stored as 0). Every check
raises ValueError naming the field, which the server turns into an HTTP 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from .slo import SLO, parse_slo
from .structured_output.limits import DEFAULT_LIMITS, exceeds, json_depth, json_text_depth

_GREEDY_EPS = 1e-5
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # OpenAI's cap on `n`; every choice is a sequence in the engine
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Constraint sizes: each is built once per request (engine/constraints.py), but its memory and the time to
# build it grow with these. The largest vocabularies in use are ~256k tokens.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_LOGIT_BIAS = 1024  # OpenAI's limit is 300
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_BAD_WORDS_TOTAL_CHARS = 16384  # two token sequences per word go into the bad-word automaton
MAX_TEMPERATURE = 1e4
MAX_REPETITION_PENALTY = 1e4
MAX_CACHE_SALT_CHARS = 1024
_TOP_K_OFF = (None, 0, -1)
# Fields whose None means "the default" (for max_tokens, seed, logprobs, ... None is a value).
_NONE_IS_DEFAULT = ("n", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "priority")

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set (vLLM's names)."""

    json: str | dict | None = None  # a JSON schema, as an object or its text
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF/GBNF (`root ::= ...`) or Lark (`start: ...`)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})

    def __post_init__(self) -> None:
        chosen = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs: set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} (got {', '.join(chosen) or 'none'})"
            )
        if self.json is not None:
            schema = self.json
            # Depth first, without recursion: `json.loads` / `json.dumps` of a value nested 100,000 deep
            # raise RecursionError (a 500), and llguidance's own JSON parser stops at 128 anyway.
            depth = json_text_depth(schema) if isinstance(schema, str) else json_depth(schema)
            if depth > DEFAULT_LIMITS.max_grammar_depth:
                raise exceeds("json", "a nesting depth of", depth, "max_grammar_depth", DEFAULT_LIMITS.max_grammar_depth)
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
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def spec(self):
        """What the grammar is, as given: the schema's canonical text, the regex, the grammar, the choices."""
        return True if self.kind == "json_object" else getattr(self, self.kind)

    @property
    def cache_key(self) -> tuple[str, str]:
        """The grammar's identity, from the request's own text: looked up before any conversion."""
        spec = self.spec
        return self.kind, "\x00".join(spec) if self.kind == "choice" else str(spec)

    def to_llguidance(self) -> str:
        """The llguidance grammar text (in this process: for trusted grammars and tests; the server
        converts in the grammar worker). ValueError naming the field when it cannot be built."""
        from .structured_output.worker import llguidance_grammar  # imports llguidance: only when called

        try:
            return llguidance_grammar(self.kind, self.spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{self.kind}: {e}") from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled (-1 and None are accepted and stored as 0)
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # a single string is accepted too
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always added)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (for echo / eval harnesses)
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs sooner (vLLM's convention)
    predicted_output_len: int | None = None  # optional hint for shortest-job-first
    # Constraints on what may be sampled (vLLM's names); ids are checked against the vocabulary by the engine.
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words that must not be generated
    structured_outputs: StructuredOutputsParams | dict | None = None  # a grammar the output must follow
    # Prefix-cache isolation (vLLM's name): requests share cached KV blocks only under the same salt.
    # A gateway sets one secret value per tenant, so no tenant can hit (and time) another's prompts.
    cache_salt: str | None = None
    # Service-level objectives (slo.py): the targets this request is scheduled for and counted against,
    # and the tenant whose fair share it draws on (`--fairness vtc`; the server sets the `user` field).
    slo: SLO | dict | None = None
    tenant: str | None = None
    # The mean of the model's final (normed) hidden state over every token it runs for this request, in
    # its output (a cascade's probe, server/cascade.py; not an API field). Such a request skips the
    # prefix cache, so the mean covers the whole prompt.
    pool_hidden: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        self._validate_constraints()

    def _validate_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias: must map token ids to biases")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias: must map integer token ids to numbers") from None
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens")
            if not all(-100 <= v <= 100 for v in self.logit_bias.values()):
                raise ValueError("logit_bias: values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids: must be a non-empty list of non-negative integers")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids (got {len(ids)})")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list | tuple) or not all(isinstance(w, str) and w for w in self.bad_words):
                raise ValueError("bad_words: must be a list of non-empty strings")
            if (len(self.bad_words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words)
                    or sum(map(len, self.bad_words)) > MAX_BAD_WORDS_TOTAL_CHARS):
                raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} "
                                 f"characters, {MAX_BAD_WORDS_TOTAL_CHARS} in all")
            self.bad_words = list(self.bad_words)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if isinstance(self.slo, dict):
            slo, cls = parse_slo(self.slo)
            if cls is not None:
                raise ValueError("slo.class: classes are the server's (--slo-classes); give ttft_ms / tpot_ms here")
            self.slo = None if slo.empty else slo
        if self.slo is not None and not isinstance(self.slo, SLO):
            raise ValueError("slo: must be an SLO or a dict of ttft_ms, tpot_ms, e2e_ms")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError("tenant: must be a string")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs: must be a StructuredOutputsParams or a dict of its fields")


    def _normalise(self) -> None:
        for name in _NONE_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, self.__dataclass_fields__[name].default)
        if self.top_k in _TOP_K_OFF:
            self.top_k = 0
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | list | tuple):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if isinstance(self.stop_token_ids, str):
            raise ValueError("stop_token_ids must be a list of integers, got str")  # noqa: TRY004 - a 400
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        """Model-independent checks (types, finiteness, ranges, size caps); the vocabulary and the
        context length are checked by `tokenloom.request_checks.check_request`."""

        def fail(name: str, why: str) -> None:
            value = getattr(self, name)
            shown = repr(value) if not isinstance(value, list | str) or len(repr(value)) < 80 else f"{type(value).__name__} of length {len(value)}"
            raise ValueError(f"{name} {why}, got {shown}")

        def integer(name: str, lo: int, hi: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not _is_int(v) or not lo <= v <= hi:
                fail(name, f"must be an integer in [{lo}, {hi}]")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
                fail(name, f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}]")

        integer("n", 1, MAX_N)
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer (int64)")
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        integer("seed", INT64_MIN, INT64_MAX, optional=True)
        integer("max_tokens", 1, INT32_MAX, optional=True)
        integer("min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        integer("logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        integer("priority", INT32_MIN, INT32_MAX)
        integer("predicted_output_len", 0, INT32_MAX, optional=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            fail("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalised(self) -> bool:
        """Does a repetition, presence or frequency penalty change the logits?"""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
