"""Request bodies of the OpenAI-compatible API as pydantic models (they also feed /openapi.json).

Types are strict (a string where a number belongs is a 400, not a silent coercion) and unknown
fields are ignored, as OpenAI clients send fields this server does not use. Defaults for
null fields and value checks (temperature >= 0, top_p in (0, 1], ...) are left to `SamplingParams`,
whose errors name the field.
vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, priority, stop_token_ids,
...) are accepted on both generation endpoints.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="Served model name; omitted = the one model served")
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token-id lists"
    )
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="Top-N logprobs per token (0-20)")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


JSON = dict[str, Any]
