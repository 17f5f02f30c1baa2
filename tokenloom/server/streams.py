"""Helpers between engine streams and HTTP: SSE framing, fan-in of several requests, deltas, aborts.

A completion request with several prompts is several engine requests; `RequestGroup.outputs`
interleaves their outputs as they come. `RequestGroup` owns those engine requests for one HTTP
request and aborts whatever has not finished when the handler exits for any reason (client gone,
error, cancel). Engine outputs are cumulative (with a possible stop-string prefix held back);
`DeltaTracker` turns them into the per-choice parts not sent yet. `until_disconnect` runs a
non-streaming handler unless the client goes away first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from ..engine.async_llm import AsyncLLM, RequestStream
from ..outputs import CompletionOutput, RequestOutput, TokenLogprobs

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
_END = object()
FAN_IN_QUEUE = 64


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class RequestGroup:
    """The engine requests behind one HTTP request."""

    def __init__(self, async_llm: AsyncLLM, base_id: str):
        self.async_llm = async_llm
        self.base_id = base_id
        self.streams: list[RequestStream] = []

    async def add_all(self, prompts: list, params, arrival_time: float, lora_request=None) -> None:
        """Add every prompt (under `lora_request`'s adapter, if any); if one is rejected, abort the
        ones already added and re-raise."""
        try:
            for i, prompt in enumerate(prompts):
                rid = self.base_id if len(prompts) == 1 else f"{self.base_id}-{i}"
                self.streams.append(await self.async_llm.add(rid, prompt, params, arrival_time, lora_request))
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.async_llm.abort(stream.request_id)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) in arrival order across all prompts."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, out
            return
        # Bounded: a pump waits for the consumer (each stream coalesces its own backlog meanwhile).
        merged: asyncio.Queue = asyncio.Queue(maxsize=FAN_IN_QUEUE)

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await merged.put((i, out))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer below
                await merged.put((i, exc))
            await merged.put((i, _END))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await merged.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def final_outputs(self) -> dict[int, RequestOutput]:
        """The last output of each prompt that produced any (an aborted one may not have)."""
        last: dict[int, RequestOutput] = {}
        async for i, out in self.outputs():
            last[i] = out
        return last


@dataclass
class ChoiceDelta:
    """The part of one choice to send: all of it for a JSON response, the new part when streaming."""

    index: int  # the choice's index in the response: prompt index * n + choice index
    prompt_index: int
    out: RequestOutput
    choice: CompletionOutput
    first: bool  # nothing of this choice was sent before
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one entry per token in token_ids, if logprobs were asked for

    @classmethod
    def whole(cls, n: int, p: int, out: RequestOutput, c: CompletionOutput) -> ChoiceDelta:
        return cls(p * n + c.index, p, out, c, True, c.text, c.token_ids, c.logprobs)


class DeltaTracker:
    """What each choice has sent so far, and the token counts for the usage chunk."""

    def __init__(self, n: int):
        self.n = n
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens); tokens -1 = finished
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}

    def deltas(self, p: int, out: RequestOutput) -> Iterator[ChoiceDelta]:
        self.prompt_tokens[p] = len(out.prompt_token_ids)
        for c in out.outputs:
            idx = p * self.n + c.index
            self.completion_tokens[idx] = len(c.token_ids)
            first = idx not in self.sent
            done_text, done_tokens = self.sent.get(idx, (0, 0))
            if done_tokens < 0:
                continue  # this choice already sent its finish_reason
            text, new_ids = c.text[done_text:], c.token_ids[done_tokens:]
            wants_lp = c.logprobs is not None and bool(new_ids)
            # The first token always gets a message, even with empty text, so clients measure
            # TTFT when it happened (vllm bench counts any message with choices).
            if not (text or c.finish_reason or wants_lp or (first and new_ids)):
                continue
            self.sent[idx] = (len(c.text), -1 if c.finish_reason else len(c.token_ids))
            logprobs = None if c.logprobs is None else c.logprobs[done_tokens:len(c.token_ids)]
            yield ChoiceDelta(idx, p, out, c, first, text, new_ids, logprobs)


async def wait_for_disconnect(receive) -> None:
    """Returns when the client has gone (the body was read already, so only disconnect remains)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it, but logs show why


async def until_disconnect(request: Request, coro) -> object:
    """Run `coro` unless the client disconnects first; then cancel it (its cleanup aborts the
    engine requests) and return a 499 response nobody will read."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED)
