"""A front's outputs at a replica, sent together on one call (pure Python, no Ray).

Ray costs CPU for every item a streaming call yields, at both ends (measured at 32 streams on 2 cores:
the front's Ray client ~10% of a core, the replica's serving threads ~7%, all preempting the engine's
threads). Stream batching (stream_batching.py) brings that down to one item per request per engine step
once steps are longer than its interval, as they are at 32 streams. Sent together, what all of a
front's requests at a replica made in one turn of the replica's loop (an engine step's outputs arrive in
one callback) is one item:

- each request's items (its first output whole, then deltas) are put into its front's `Outbox`,
  as `(request id, item)`;
- the front keeps one call open to each replica it has requests on, `EngineReplica.mailbox`, which
  yields the outbox's batches (`batches`), in order: one per turn of the loop that put something. The
  replica ends it once the front has had nothing there for a while (a replica being stopped waits
  for its calls to end), and the front calls again when it has a request there again;
- a request's own call carries only its acceptance and how it ended (an error is raised on it), and
  Ray's cancelling it when the caller goes away aborts the request, as before. Cancelling never loses
  another request's output: the mailbox call is not cancelled while the front lives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

Item = tuple[str, object]  # (request id, a RequestOutput, an OutputDelta or ENDED)


class Outbox:
    def __init__(self) -> None:
        self._items: list[Item] = []
        self._ready = asyncio.Event()
        self._ready_soon = False
        self._consumer: object | None = None
        self.requests = 0  # the front's requests running at the replica

    def put(self, request_id: str, item: object) -> None:
        self._items.append((request_id, item))
        if not self._ready_soon:  # once the rest of this turn's outputs are in
            self._ready_soon = True
            asyncio.get_running_loop().call_soon(self._set_ready)

    def _set_ready(self) -> None:
        self._ready_soon = False
        self._ready.set()

    @property
    def idle(self) -> bool:
        return not self.requests and not self._items

    async def batches(self, idle_s: float) -> AsyncIterator[list[Item]]:
        """Everything put, in order, a batch per turn of the loop that put some. Ends when nothing was
        put for `idle_s` seconds and no request is running, so that a replica being stopped is not kept
        waiting for this call to end. One consumer: a newer one (the front's mailbox call made again)
        ends the older at its next wake-up."""
        self._consumer = me = object()
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    await self._ready.wait()
            except TimeoutError:
                if self.idle:
                    return
                continue
            if self._consumer is not me:
                return
            self._ready.clear()
            batch, self._items = self._items, []
            if batch:
                yield batch
