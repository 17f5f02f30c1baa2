"""Per-request generation parameters, with vLLM's field names, normalisation and validation.

Normalisation happens here once, for the offline `LLM` API and the server alike: `stop` may be a
string or a list, `None` stands for a field's default (temperature, top_p, top_k, min_p, the
penalties, stop lists, ...), and top_k 0, -1 or None all mean "off" (stored as 0). Every check
raises ValueError naming the field, which the server turns into an HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_TOP_K_OFF = (None, 0, -1)
# Fields whose None means "the default" (for max_tokens, seed, logprobs, ... None is a value).
_NONE_IS_DEFAULT = ("n", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "priority")


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

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        self._validate_constraints()

    def _validate_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map integer token ids to numbers") from None
            if not all(-100 <= v <= 100 for v in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative integers")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list | tuple) or not all(isinstance(w, str) and w for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")

    def token_ids_to_check(self) -> list[int]:
        """Every token id the parameters name, for the engine's vocabulary check."""
        return [*self.stop_token_ids, *(self.logit_bias or ()), *(self.allowed_token_ids or ())]

    def _normalise(self) -> None:
        for name in _NONE_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, self.__dataclass_fields__[name].default)
        if self.top_k in _TOP_K_OFF:
            self.top_k = 0
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            fail("prompt_logprobs", "must be in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)
