"""What every route needs: the AsyncLLM, the served names, ids, and the run-until-disconnect helper."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from ..engine.async_llm import AsyncLLM
from .errors import APIError
from .streams import wait_for_disconnect


@dataclass
class ServerState:
    async_llm: AsyncLLM
    served_model_names: list[str]
    model_path: str | None = None
    metrics: object | None = None  # EngineMetrics

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.async_llm.tokenizer

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.model_name if name is None else name
        raise APIError(
            404, f"The model `{name}` does not exist. Served: {', '.join(self.served_model_names)}",
            "invalid_request_error", "model", "model_not_found",
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


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
