"""Request bodies of the OpenAI-compatible API as pydantic models (they also feed /openapi.json).

Types are strict (a string where a number belongs is a 400, not a silent coercion) and unknown
fields are ignored, as OpenAI clients send fields this server does not use. Defaults for
null fields and value checks (temperature >= 0, top_p in (0, 1], ...) are left to `SamplingParams`,
whose errors name the field.
vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, priority, stop_token_ids,
...) are accepted on both generation endpoints.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_PROMPTS = 128  # prompts in one completion request (each is an engine request)
MAX_MESSAGES = 4096
MAX_TOKEN_IDS = 1 << 20  # ids in one token-id prompt or /detokenize request (the body limit binds first)


def _utf8(value: str) -> str:
    """Python's JSON parser lets a lone UTF-16 surrogate ("\\ud800") through; nothing can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate at index {exc.start}; send valid Unicode") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = Field(None, description="Served model name; omitted = the one model served")
    n: int | None = Field(None, description="Choices per prompt (1-128); null = 1")
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: Text | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = Field(0, description="Lower runs sooner (vLLM's convention); by default a client may only "
                          "lower its own priority (>= 0): the server's --min-client-priority bounds it")
    slo: dict[str, Any] | None = Field(
        None, description="This request's latency targets: {ttft_ms, tpot_ms, e2e_ms} and/or a class of the "
        "server's --slo-classes file; unset fields come from the tenant's class and the server's defaults")
    cache_salt: Text | None = Field(
        None, description="Prefix-cache isolation (vLLM's field): requests share cached KV only under the same salt")
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constraints on the output
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100]")
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's structured outputs: one of json, regex, choice, grammar, json_object")
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token-id lists"
    )
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="Top-N logprobs per token (0-20)")
    echo: bool | None = False
    suffix: Text | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Text
    text: Text | None = None


class CalledFunction(_Body):
    name: Text
    arguments: Text = Field(..., description="The call's arguments as a JSON object in a string, as OpenAI returns them")


class AssistantToolCall(_Body):
    """A call an earlier assistant turn made (an entry of its `tool_calls`), rendered by the chat template."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """Only these fields reach the chat template; others are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=MAX_MESSAGES)
    tool_call_id: Text | None = None


class FunctionDefinition(_Body):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Text = "function"
    function: FunctionDefinition | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    functions: list[Any] | None = Field(None, description="Deprecated by OpenAI; not supported (use tools)")
    function_call: Text | dict[str, Any] | None = Field(None, description="Not supported (use tool_choice)")
    audio: dict[str, Any] | None = Field(None, description="Not supported")
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Further variables for the chat template, e.g. {\"enable_thinking\": false} (vLLM's)")


class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int] = Field(..., max_length=MAX_TOKEN_IDS)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


JSON = dict[str, Any]
