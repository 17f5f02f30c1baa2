"""Pure conversions between the OpenAI protocol and the engine (no I/O, unit-testable).

- request fields -> `SamplingParams` (a name mapping: it applies defaults and checks values);
- completion `prompt` -> list of engine prompts; chat `messages` -> template-ready dicts;
- engine logprobs -> OpenAI's completions format (`tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`, with `echo` putting the prompt first and its first token's logprob null, as
  lm-evaluation-harness expects) and the chat format (`content: [{token, logprob, bytes,
  top_logprobs}]`).
"""

from __future__ import annotations

import json

from ..model.tokenizer import IncrementalDetokenizer
from ..sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from .errors import APIError
from .protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, _SamplingFields
from .structured import ToolChoice, structured_outputs

# Engine sequences one request may create (prompts x n), checked before any is created.
MAX_SEQUENCES_PER_REQUEST = 256

# Request fields that `SamplingParams` takes under the same name; it normalises their values
# (None = default, stop as str or list, top_k 0/-1/None = off) and checks them.
_SAME_NAME = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "skip_special_tokens", "priority", "logit_bias", "allowed_token_ids", "bad_words",
    "cache_salt",
)


def sampling_params(req: _SamplingFields, **fields) -> SamplingParams:
    """The shared fields by name plus the endpoint's own (`fields`); raises ValueError naming the
    field for values out of range."""
    fields.setdefault("structured_outputs", structured_outputs(req))
    return SamplingParams(**{name: getattr(req, name) for name in _SAME_NAME}, **fields)


def refuse_unsupported(req, names: tuple[str, ...]) -> None:
    """A field this server does not implement is a 400 naming it, never silently ignored."""
    for name in names:
        if getattr(req, name, None) not in (None, "", False):
            raise APIError(400, f"{name}: not supported by this server", param=name)


def completion_params(req: CompletionRequest) -> SamplingParams:
    refuse_unsupported(req, ("suffix",))
    if req.best_of is not None and not 1 <= req.best_of <= MAX_N:
        raise APIError(400, f"best_of: must be an integer in [1, {MAX_N}], got {req.best_of}", param="best_of")
    if req.best_of is not None and req.n is not None and req.best_of < req.n:
        raise APIError(400, f"best_of: must be >= n ({req.n}), got {req.best_of}", param="best_of")
    if req.best_of is not None and req.best_of > (req.n or 1):
        raise APIError(400, "best_of: only best_of = n is supported (vLLM v1 dropped best_of too)", param="best_of")
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # echo + logprobs = score the prompt too (eval harnesses)
    else:
        prompt_logprobs = req.prompt_logprobs
    return sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)


def chat_params(req: ChatCompletionRequest, tools: ToolChoice | None = None) -> SamplingParams:
    refuse_unsupported(req, ("functions", "function_call", "audio"))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                       param="top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if tools is None or tools.auto:  # "auto" is read back from the text (tool_parser.py), not forced
        return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    if structured_outputs(req) is not None:
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format or "
                       "structured_outputs", param="tool_choice")
    return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=tools.grammar())


def completion_prompts(prompt, n: int = 1) -> list[str | list[int]]:
    """A string, list of strings, token ids or list of token-id lists -> one engine prompt each
    (at most MAX_PROMPTS, and at most MAX_SEQUENCES_PER_REQUEST sequences counting `n` each)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    count = 1 if isinstance(prompt[0], int) else len(prompt)
    if count > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {count}", param="prompt")
    if count * n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"n: {count} prompts x n={n} is {count * n} sequences; at most "
                       f"{MAX_SEQUENCES_PER_REQUEST} per request", param="n")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list) and any(not p for p in prompt):
        raise APIError(400, "prompt: token-id lists must not be empty", param="prompt")
    return list(prompt)


def chat_messages(req: ChatCompletionRequest, tools: ToolChoice | None = None) -> list[dict]:
    """Messages as the chat template expects them: content flattened to a string (text parts only:
    an image or audio part is a 400), earlier calls' arguments as objects, the tools described in the
    system message when a call is forced and the template has no place for them."""
    out = []
    for i, m in enumerate(req.messages):
        msg = m.model_dump(exclude_none=True)
        if m.tool_calls is not None:
            msg["tool_calls"] = [_template_tool_call(f"messages[{i}].tool_calls[{j}]", call)
                                 for j, call in enumerate(msg["tool_calls"])]
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text":
                    raise APIError(400, f"messages[{i}].content: {part.type!r} parts are not supported "
                                   "(this model reads text only)", param=f"messages[{i}].content")
            msg["content"] = "".join(p.text or "" for p in m.content if p.type == "text")
        elif m.content is None:
            msg["content"] = ""
        out.append(msg)
    if tools is not None and tools.template_tools is None:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{tools.system_prompt()}"
        else:
            out.insert(0, {"role": "system", "content": tools.system_prompt()})
    return out


def _template_tool_call(where: str, call: dict) -> dict:
    """An earlier call as templates read it: OpenAI sends its arguments as a JSON string, templates
    (Qwen2.5's `tool_call.arguments | tojson`) expect the object, so it is parsed (as vLLM does)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except (ValueError, RecursionError):
        raise APIError(400, f"{where}.function.arguments: must be a JSON text (OpenAI sends the arguments "
                       "as a JSON object in a string)", param="messages") from None
    return {**call, "function": {**call["function"], "arguments": arguments}}


# -- logprobs ------------------------------------------------------------------------------------


def token_text(tokenizer, token_id: int) -> str:
    """The token as logprobs show it: its text, or for a token that is not whole UTF-8 (part of a
    character) "bytes:" and its bytes escaped, as vLLM writes it, so distinct tokens keep distinct keys."""
    s = tokenizer.id_to_token(token_id)
    if "\ufffd" not in s:
        return s
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")  # a real U+FFFD in the token
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(lp: float | None) -> float | None:
    """JSON has no -inf: a token the sampler ruled out (min_tokens ban, top-k) reports -9999.0, as vLLM does."""
    return None if lp is None else max(-9999.0, lp)  # NaN -> -9999.0 too


def _pad_front(token_ids: list[int], entries: list) -> list:
    """Prompt logprobs may omit the first token's (nothing predicts it): it is null."""
    missing = len(token_ids) - len(entries)
    return [None] * missing + list(entries) if missing > 0 else list(entries)


class CompletionLogprobs:
    """Builds OpenAI completions `logprobs` incrementally (streaming sends the newest part).

    `text_offset` is the index in the choice's returned text (a str, so in characters) where each
    token's text begins: the length of what the tokens before it decode to, as the engine decodes
    them (incrementally: a token that ends inside a character adds nothing until the one that
    completes it; special tokens count only if the text shows them). The prompt (echo) decodes with
    its special tokens shown, as the echoed text has them."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.offset = 0  # characters of the choice's returned text so far
        self._detok: IncrementalDetokenizer | None = None
        self._detok_prompt: bool | None = None

    def part(self, token_ids: list[int], entries: list, prompt: bool = False) -> dict:
        if self._detok is None or self._detok_prompt != prompt:
            self._detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=not prompt and self.skip_special_tokens)
            self._detok_prompt = prompt
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, _pad_front(token_ids, entries), strict=True):
            s = token_text(self.tokenizer, tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(self._detok.step(tid))
            if entry is None:  # the first prompt token: nothing predicts it
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_finite(entry.get(tid)))
                tops.append({token_text(self.tokenizer, t): _finite(lp) for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def clamp_offsets(logprobs: dict | None, text_length: int) -> dict | None:
    """A finished choice's text may end before its last tokens' text (cut at a stop string): their
    offsets point at its end."""
    if logprobs is not None:
        logprobs["text_offset"] = [min(o, text_length) for o in logprobs["text_offset"]]
    return logprobs


def merge_logprob_parts(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, top_n: int) -> dict:
    def item(i: int, lp) -> dict:
        return {"token": token_text(tokenizer, i), "logprob": _finite(lp), "bytes": list(tokenizer.token_bytes(i))}

    content = []
    for tid, entry in zip(token_ids, _pad_front(token_ids, entries), strict=True):
        entry = entry or {}
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(i, lp) for i, lp in ranked]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
