"""POST /v1/chat/completions: messages through the model's chat template, then one engine request.

Streaming sends, per choice, a first delta carrying the role together with the first text, then
content deltas, then a delta with the finish_reason. The role goes out only once the first token
exists: benchmark clients (vllm bench serve) take TTFT from the first message with choices, so a
role-only message sent at once would report a TTFT that never happened.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.async_llm import EngineDeadError
from ..outputs import RequestOutput
from . import convert
from .errors import APIError, error_body, from_exception
from .protocol import ChatCompletionRequest
from .state import ServerState, new_id, now_s, until_disconnect
from .streams import DONE, SSE_HEADERS, SSE_MEDIA_TYPE, RequestGroup, sse


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> str:
    try:
        return state.tokenizer.apply_chat_template(convert.chat_messages(req), req.add_generation_prompt)
    except ValueError:
        raise
    except Exception as exc:  # jinja errors: the messages do not fit the template
        raise APIError(400, f"messages: the chat template failed: {exc}", param="messages") from exc


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState):
    arrival = time.monotonic()
    model = state.check_model(req.model)
    params = convert.chat_params(req)
    prompt = render_prompt(state, req)
    group = RequestGroup(state.async_llm, new_id("chatcmpl"))
    await group.add_all([prompt], params, arrival)
    view = _ChatView(state, req, group.base_id, model)
    if req.stream:
        return StreamingResponse(view.stream(group), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)

    async def collect():
        try:
            outputs = await group.final_outputs()
            return JSONResponse(view.response(outputs[0]) if outputs else view.aborted())
        finally:
            group.abort_unfinished()

    return await until_disconnect(request, collect())


class _ChatView:
    def __init__(self, state: ServerState, req: ChatCompletionRequest, rid: str, model: str):
        self.state, self.req, self.id, self.model = state, req, rid, model
        self.created = now_s()
        self.tok = state.tokenizer
        self.top_n = req.top_logprobs or 0

    def _logprobs(self, token_ids: list[int], entries) -> dict | None:
        if entries is None:
            return None
        return convert.chat_logprobs(self.tok, token_ids, entries, self.top_n)

    def response(self, out: RequestOutput) -> dict:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": convert.usage(len(out.prompt_token_ids), completion_tokens),
        }

    def aborted(self) -> dict:
        raise APIError(503, "the request was aborted (server shutting down)", "server_error", code="aborted")

    def _chunk(self, choices: list[dict], **extra) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": choices, **extra})

    async def stream(self, group: RequestGroup):
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        last: RequestOutput | None = None
        try:
            async for _, out in group.outputs():
                last = out
                for c in out.outputs:
                    first = c.index not in sent_tokens
                    if not first and sent_tokens[c.index] < 0:
                        continue
                    done_text, done_tokens = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                    delta_text = c.text[done_text:]
                    new_ids = c.token_ids[done_tokens:]
                    wants_lp = c.logprobs is not None and bool(new_ids)
                    if not (delta_text or c.finish_reason or wants_lp or (first and new_ids)):
                        continue
                    delta = {"role": "assistant", "content": delta_text} if first else {}
                    if delta_text and not first:
                        delta["content"] = delta_text
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = self._logprobs(new_ids, c.logprobs[done_tokens:len(c.token_ids)])
                    sent_text[c.index] = len(c.text)
                    sent_tokens[c.index] = -1 if c.finish_reason else len(c.token_ids)
                    yield self._chunk([{
                        "index": c.index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    }])
            opts = self.req.stream_options
            if opts is not None and opts.include_usage and last is not None:
                completion_tokens = sum(len(c.token_ids) for c in last.outputs)
                yield self._chunk([], usage=convert.usage(len(last.prompt_token_ids), completion_tokens))
        except EngineDeadError as exc:
            err = from_exception(exc)
            yield sse(error_body(err.message, err.type, err.param, err.code))
        finally:
            group.abort_unfinished()
        yield DONE
