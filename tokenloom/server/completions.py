"""POST /v1/completions: prompts in, text (or an SSE stream of text deltas) out.

Each prompt is one engine request with `n` choices; choice index = prompt index * n + choice.
Engine outputs are cumulative (with a possible stop-string prefix held back), so streaming sends
the part of each choice's text and tokens not sent yet.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.async_llm import EngineDeadError
from ..outputs import RequestOutput
from . import convert
from .errors import error_body, from_exception
from .protocol import CompletionRequest
from .state import ServerState, new_id, now_s, until_disconnect
from .streams import DONE, SSE_HEADERS, SSE_MEDIA_TYPE, RequestGroup, sse


async def create_completion(req: CompletionRequest, request: Request, state: ServerState):
    arrival = time.monotonic()
    model = state.check_model(req.model)
    params = convert.completion_params(req)
    prompts = convert.completion_prompts(req.prompt)
    group = RequestGroup(state.async_llm, new_id("cmpl"))
    await group.add_all(prompts, params, arrival)  # validation errors surface here, as 400s
    view = _CompletionView(state, req, group.base_id, model, prompts)
    if req.stream:
        return StreamingResponse(view.stream(group), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)

    async def collect():
        try:
            return JSONResponse(view.response(await group.final_outputs()))
        finally:
            group.abort_unfinished()

    return await until_disconnect(request, collect())


class _CompletionView:
    def __init__(self, state: ServerState, req: CompletionRequest, rid: str, model: str, prompts: list):
        self.state, self.req, self.id, self.model, self.prompts = state, req, rid, model, prompts
        self.created = now_s()
        self.tok = state.tokenizer

    def _prompt_text(self, p: int, out: RequestOutput) -> str:
        prompt = self.prompts[p]
        return prompt if isinstance(prompt, str) else self.tok.decode(out.prompt_token_ids, False)

    def _prompt_logprobs(self, lp: convert.CompletionLogprobs, out: RequestOutput) -> dict | None:
        if out.prompt_logprobs is None:
            return None
        return lp.part(out.prompt_token_ids, out.prompt_logprobs)

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                lp = convert.CompletionLogprobs(self.tok)
                if self.req.echo:
                    text = self._prompt_text(p, out) + text
                    logprobs = self._prompt_logprobs(lp, out)
                if c.logprobs is not None:
                    logprobs = convert.merge_logprob_parts(logprobs, lp.part(c.token_ids, c.logprobs))
                choices.append({
                    "index": p * self.req.n + c.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": convert.usage(prompt_tokens, completion_tokens),
        }

    def _chunk(self, choices: list[dict]) -> str:
        return sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": choices})

    async def stream(self, group: RequestGroup):
        n = self.req.n
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        lps: dict[int, convert.CompletionLogprobs] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            async for p, out in group.outputs():
                prompt_tokens[p] = len(out.prompt_token_ids)
                for c in out.outputs:
                    idx = p * n + c.index
                    completion_tokens[idx] = len(c.token_ids)
                    first = idx not in sent_tokens
                    if not first and sent_tokens[idx] < 0:
                        continue  # this choice already sent its finish_reason
                    done_text, done_tokens = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
                    delta = c.text[done_text:]
                    new_ids = c.token_ids[done_tokens:]
                    wants_lp = c.logprobs is not None and bool(new_ids)
                    # The first token always gets a message, even with empty text, so clients
                    # measure TTFT when it happened (vllm bench counts any message with choices).
                    if not (delta or c.finish_reason or wants_lp or (first and new_ids)):
                        continue
                    logprobs = None
                    if first:
                        lps[idx] = convert.CompletionLogprobs(self.tok)
                        if self.req.echo:
                            delta = self._prompt_text(p, out) + delta
                            logprobs = self._prompt_logprobs(lps[idx], out)
                    if c.logprobs is not None:
                        part = lps[idx].part(new_ids, c.logprobs[done_tokens:len(c.token_ids)])
                        logprobs = convert.merge_logprob_parts(logprobs, part)
                    sent_text[idx] = len(c.text)
                    sent_tokens[idx] = -1 if c.finish_reason else len(c.token_ids)
                    yield self._chunk([{
                        "index": idx, "text": delta, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    }])
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                yield sse({
                    "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [], "usage": convert.usage(sum(prompt_tokens.values()), sum(completion_tokens.values())),
                })
        except EngineDeadError as exc:
            err = from_exception(exc)
            yield sse(error_body(err.message, err.type, err.param, err.code))
        finally:
            group.abort_unfinished()  # client gone or error: free the engine's blocks now
        yield DONE
