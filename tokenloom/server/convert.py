"""Pure conversions between the OpenAI protocol and the engine (no I/O, unit-testable).

- request fields -> `SamplingParams` (a name mapping: it applies defaults and checks values);
- completion `prompt` -> list of engine prompts; chat `messages` -> template-ready dicts;
- engine logprobs -> OpenAI's completions format (`tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`, with `echo` putting the prompt first and its first token's logprob null, as
  lm-evaluation-harness expects) and the chat format (`content: [{token, logprob, bytes,
  top_logprobs}]`).
"""

from __future__ import annotations

from ..sampling_params import SamplingParams
from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

# Request fields that `SamplingParams` takes under the same name; it normalises their values
# (None = default, stop as str or list, top_k 0/-1/None = off) and checks them.
_SAME_NAME = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "skip_special_tokens", "priority",
)


def sampling_params(req: _SamplingFields, **fields) -> SamplingParams:
    """The shared fields by name plus the endpoint's own (`fields`); raises ValueError naming the
    field for values out of range."""
    return SamplingParams(**{name: getattr(req, name) for name in _SAME_NAME}, **fields)


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        prompt_logprobs = req.logprobs  # echo + logprobs = score the prompt too (eval harnesses)
    else:
        prompt_logprobs = req.prompt_logprobs
    return sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)


def completion_prompts(prompt) -> list[str | list[int]]:
    """A string, list of strings, token ids or list of token-id lists -> one engine prompt each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list) and any(not p for p in prompt):
        raise APIError(400, "prompt: token-id lists must not be empty", param="prompt")
    return list(prompt)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: content flattened to a string."""
    out = []
    for m in req.messages:
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            msg["content"] = "".join(p.text or "" for p in m.content if p.type == "text")
        elif m.content is None:
            msg["content"] = ""
        out.append(msg)
    return out


# -- logprobs ------------------------------------------------------------------------------------


class CompletionLogprobs:
    """Builds OpenAI completions `logprobs` incrementally (streaming sends the newest part)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0  # text offsets count from the start of the choice's returned text

    def part(self, token_ids: list[int], entries: list) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries, strict=True):
            s = self.tokenizer.id_to_token(tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if entry is None:  # the first prompt token: nothing predicts it
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(entry.get(tid))
                tops.append({self.tokenizer.id_to_token(t): lp for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_logprob_parts(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, top_n: int) -> dict:
    content = []
    for tid, entry in zip(token_ids, entries, strict=True):
        s = tokenizer.id_to_token(tid)
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append({
            "token": s,
            "logprob": entry.get(tid),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := tokenizer.id_to_token(i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                for i, lp in ranked
            ],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
