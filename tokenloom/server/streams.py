"""Helpers between engine streams and HTTP: SSE framing, fan-in of several requests, aborts.

A completion request with several prompts is several engine requests; `merge` interleaves their
outputs as they come. `RequestGroup` owns those engine requests for one HTTP request and aborts
whatever has not finished when the handler exits for any reason (client gone, error, cancel).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from ..engine.async_llm import AsyncLLM, RequestStream
from ..outputs import RequestOutput

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
_END = object()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class RequestGroup:
    """The engine requests behind one HTTP request."""

    def __init__(self, async_llm: AsyncLLM, base_id: str):
        self.async_llm = async_llm
        self.base_id = base_id
        self.streams: list[RequestStream] = []

    async def add_all(self, prompts: list, params, arrival_time: float) -> None:
        """Add every prompt; if one is rejected, abort the ones already added and re-raise."""
        try:
            for i, prompt in enumerate(prompts):
                rid = self.base_id if len(prompts) == 1 else f"{self.base_id}-{i}"
                self.streams.append(await self.async_llm.add(rid, prompt, params, arrival_time))
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
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    merged.put_nowait((i, out))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer below
                merged.put_nowait((i, exc))
            finally:
                merged.put_nowait((i, _END))

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

    async def final_outputs(self) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in self.outputs():
            last[i] = out
        return [last[i] for i in range(len(self.streams)) if i in last]


async def wait_for_disconnect(receive) -> None:
    """Returns when the client has gone (the body was read already, so only disconnect remains)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
