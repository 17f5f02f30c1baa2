"""One generation request over HTTP, for /v1/completions and /v1/chat/completions alike.

`GenerationView` adds the engine requests, then either aggregates their final outputs into one
JSON response (abandoned if the client disconnects) or streams SSE chunks of the parts not sent
yet, ending with the optional usage chunk and `data: [DONE]`; either way it aborts whatever is
unfinished when it exits. An endpoint subclasses it and says only how a choice is rendered
(`render`), from a `ChoiceDelta` that is the whole choice in a response or its new part in a stream.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from ..outputs import RequestOutput
from ..request_checks import check_request
from ..sampling_params import SamplingParams
from . import convert
from .connection import WriteTimeoutStreamingResponse
from .errors import APIError, SafeJSONResponse, from_exception
from .protocol import _SamplingFields
from .state import ServerState, new_id, now_s
from .streams import (
    DONE,
    SSE_HEADERS,
    SSE_MEDIA_TYPE,
    ChoiceDelta,
    DeltaTracker,
    RequestGroup,
    sse,
    until_disconnect,
)


class GenerationView(abc.ABC):
    """Subclassed once per endpoint (`_CompletionView`, `_ChatView`), which supply the two abstract methods."""

    id_prefix: str  # "cmpl", "chatcmpl"
    object: str  # the response's "object"
    chunk_object: str  # a stream chunk's "object"

    def __init__(self, state: ServerState, req: _SamplingFields, model: str):
        self.state, self.req, self.model = state, req, model
        self.id = new_id(self.id_prefix)
        self.created = now_s()
        self.tok = state.tokenizer
        self.n = 1  # choices per prompt, once the params are known
        # Extra top-level fields of the response and the stream's last chunk, given the usage; a `usage`
        # it returns replaces the view's (a cascade's, cascade.py; in a stream only with include_usage).
        self.annotate: Callable[[dict], dict] | None = None

    @abc.abstractmethod
    async def engine_inputs(self) -> tuple[SamplingParams, list[list[int]]]:
        """The sampling params and the prompts' token ids (raises APIError/ValueError for bad input);
        long texts are rendered and tokenized off the event loop."""

    @abc.abstractmethod
    def render(self, d: ChoiceDelta, streaming: bool) -> dict:
        """The endpoint's fields of one choice (text or message/delta, logprobs)."""

    def _choice(self, d: ChoiceDelta, streaming: bool) -> dict:
        c = d.choice
        return {"index": d.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **self.render(d, streaming)}

    @classmethod
    async def create(cls, req: _SamplingFields, request: Request, state: ServerState):
        """The route handler: a JSON response or a StreamingResponse."""
        view, group = await cls.start(req, state)
        return await view.respond(group, request)

    @classmethod
    async def start(cls, req: _SamplingFields, state: ServerState, model: str | None = None,
                    adjust: Callable[[SamplingParams], None] | None = None) -> tuple[GenerationView, RequestGroup]:
        """The view and its engine requests, added (a cascade, cascade.py, reads their first tokens before
        `respond`); `model`: the name the response carries (default: the request's, checked);
        `adjust`: a last change to the params before the checks (a cascade's logprobs)."""
        arrival = time.monotonic()
        view = cls(state, req, model or state.check_model(req.model))
        params, prompts = await view.engine_inputs()
        if adjust is not None:
            adjust(params)
        state.client_priority.check(params.priority)  # the operator's range, not the engine's int32
        params.tenant = req.user
        params.slo = state.slo_policy.resolve(req.slo, req.user)  # a bad field or class: a 400 naming it
        view.n = params.n
        for ids in prompts:  # the model-dependent checks, before anything reaches the engine thread
            check_request(params, ids, state.vocab_size, state.max_model_len)
        if params.structured_outputs is not None:  # compiled (or found in the cache) off the event loop
            await state.run_off_loop(state.async_llm.engine.grammars.compile, params.structured_outputs)
        lora = await state.lora_for(view.model)  # pinned for the admission
        group = RequestGroup(state.async_llm, view.id)
        try:
            await group.add_all(prompts, params, arrival, lora)  # validation errors surface here, as 400s
        finally:
            if lora is not None:  # the engine's own pins hold it from here
                state.adapters.release(lora.lora_name)
        return view, group

    async def respond(self, group: RequestGroup, request: Request):
        """The JSON response or the StreamingResponse of the group's outputs."""
        if self.req.stream:  # null = false
            return WriteTimeoutStreamingResponse(self.stream(group), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
        return await until_disconnect(request, self.collect(group))

    # -- one JSON response -----------------------------------------------------------------------

    async def collect(self, group: RequestGroup) -> JSONResponse:
        try:
            return SafeJSONResponse(self.response(await group.final_outputs(), len(group.streams)))
        except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI-shaped body
            return from_exception(exc).response()
        finally:
            group.abort_unfinished()

    def response(self, outputs: dict[int, RequestOutput], num_prompts: int) -> dict:
        if failed := [out.error for out in outputs.values() if out.error is not None]:
            raise _failed(failed[0])
        if len(outputs) < num_prompts or not all(out.finished for out in outputs.values()):
            raise _aborted()
        choices = [self._choice(ChoiceDelta.whole(self.n, p, out, c), False)
                   for p, out in outputs.items() for c in out.outputs]
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs.values())
        completion_tokens = sum(len(c.token_ids) for out in outputs.values() for c in out.outputs)
        usage = convert.usage(prompt_tokens, completion_tokens)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, **(self.annotate(usage) if self.annotate else {})}

    # -- an SSE stream ---------------------------------------------------------------------------

    def _chunk(self, choices: list[dict], **extra) -> str:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                    "choices": choices, **extra})

    async def stream(self, group: RequestGroup):
        tracker = DeltaTracker(self.n)
        finished: set[int] = set()
        try:
            async for p, out in group.outputs():
                if out.error is not None:  # an error failed this request (alone)
                    raise _failed(out.error)
                if out.finished:
                    finished.add(p)
                for d in tracker.deltas(p, out):
                    yield self._chunk([self._choice(d, True)])
            if len(finished) < len(group.streams):  # the engine aborted it: the server is shutting down
                raise _aborted()
            usage = convert.usage(sum(tracker.prompt_tokens.values()), sum(tracker.completion_tokens.values()))
            include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
            extra = {"usage": usage} if include_usage else {}
            if self.annotate is not None:
                fields = self.annotate(usage)
                extra.update(fields if include_usage else {k: v for k, v in fields.items() if k != "usage"})
            if extra:
                yield self._chunk([], **extra)
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event, then [DONE]
            yield sse(from_exception(exc).body())
        finally:
            group.abort_unfinished()  # client gone or error: free the engine's blocks now
        yield DONE


def _aborted() -> APIError:
    return APIError(503, "the request was aborted before it finished (the server is shutting down)",
                    "server_error", code="aborted")


def _failed(error: str) -> APIError:
    """A request that failed alone: its grammar (structured_outputs.GrammarError: too complex for the
    lexer, or needing bytes no token of this model has) is the request's doing, a 400; anything else
    is the server's, a 500."""
    if error.startswith("structured_outputs:"):
        return APIError(400, error, "invalid_request_error", param="structured_outputs", code="grammar_failed")
    return APIError(500, error, "server_error", code="internal_error")
