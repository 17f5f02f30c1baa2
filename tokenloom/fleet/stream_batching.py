"""Stream batching at a replica: at most one streamed item per interval per request (pure Python, no Ray).

Ray costs CPU for every item a replica's streaming call yields (about 1 ms at the front and 0.5 ms at
the replica, measured), and on a small machine that CPU preempts the engine's own threads. One item
per engine step makes it a cost per token; batching the stream makes it a cost per interval. It is what
Ray Serve LLM does with its `stream_batching_interval_ms` (the flag's name here).

- The first output goes at once, whole: time to first token does not grow.
- After an item is sent, what the engine makes within the interval is merged: outputs are cumulative,
  so the merged item is the delta from the last output sent to the newest one (wire.py). It goes with
  the first output that arrives once the interval has passed, so every request's item leaves right
  after an engine step, in one wake-up of the replica's loop. (A timer per request, the first version,
  woke the loop at scattered times, up to once per request per step, each wake-up taking the GIL from
  the engine thread; at 32 streams a 50 ms interval measured slower than none.) Only a stream gone quiet (no output for a further interval: a
  preempted or stalled request) sends what it holds on a timer. If nothing was held, the next output
  goes as soon as it comes.
- The final output goes at once: a request never ends late for the interval.
- Interval 0: one item per output, as before batching.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ..engine.async_llm import RequestStream
from ..outputs import RequestOutput
from .wire import OutputDelta, output_delta


async def batched_items(stream: RequestStream, interval_s: float) -> AsyncIterator[RequestOutput | OutputDelta]:
    """One request's wire items: its first output whole, then `OutputDelta`s, at most one per
    `interval_s` seconds but the last (the rules above). Ends with the stream (finished or aborted);
    the engine's error is raised. Cancelling the consumer cancels the wait for an output, which loses
    nothing (RequestStream.latest)."""
    first = await stream.latest()
    if first is None:  # aborted before its first output
        return
    yield first
    sent, sent_at = first, time.monotonic()
    held: RequestOutput | None = None  # newer than `sent`, waiting for the interval to pass
    while not sent.finished:
        due = sent_at + interval_s
        if held is None:
            out = await stream.latest()  # the next output, however long it takes
        else:  # the next step's output; a timer only for a stream gone quiet
            out = await stream.latest(max(due - time.monotonic(), 0.0) + interval_s)
        if out is not None:
            held = out
        elif held is None:  # without a timeout, nothing comes only from an aborted stream
            return
        # The final output, or an aborted stream's last tokens, go now: nothing newer will come.
        if stream.finished or time.monotonic() >= due:
            yield output_delta(sent, held)
            sent, sent_at, held = held, time.monotonic(), None
