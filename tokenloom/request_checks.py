"""Model-dependent request checks, shared by the server (before it submits) and the engine.

`SamplingParams` checks what needs no model (types, finite numbers, ranges, size caps). What depends
on the model lives here, in one function with no imports from the engine, so the HTTP server can
refuse a request on the event loop before anything reaches the engine thread and
`LLMEngine.add_request` can run the very same checks for the offline API:

- every prompt token id and every id in `stop_token_ids`, `allowed_token_ids` and `logit_bias` is in
  [0, vocab_size);
- the prompt leaves room to generate, and prompt + max_tokens / min_tokens fit max_model_len.

Every failure is a ValueError whose message starts with the field's name (the server's 400 `param`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling_params import SamplingParams


def check_request(params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("prompt: must not be empty")
    bad = next((t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: every token id must be an integer in [0, {vocab_size}), got {bad!r}")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        bad = next((t for t in getattr(params, name) or () if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: every token id must be in [0, {vocab_size}), got {bad}")
    if n >= max_model_len:
        raise ValueError(f"prompt: {n} tokens, but max_model_len is {max_model_len} (room is needed to generate)")
    room = max_model_len - n
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"max_tokens: this model's maximum context length is {max_model_len} tokens, but {n + params.max_tokens} "
            f"were requested ({n} in the prompt, {params.max_tokens} in the completion)"
        )
    if params.min_tokens > room:
        raise ValueError(f"min_tokens: must be <= {room} (the context left after the {n}-token prompt), got {params.min_tokens}")
