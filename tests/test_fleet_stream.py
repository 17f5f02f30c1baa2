"""Stream batching at a fleet replica (fleet/stream_batching.py), the stream's `latest` it is built on
(engine/async_llm.py), a replica's `generate` around it when its caller goes away, and the flag:
pure Python and asyncio with short real intervals, no Ray, no model.

The timings assert only what holds on a loaded machine: an item that must wait for the interval is never
early, and one that must not wait comes long before the interval (seconds) would have let it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenloom.cli import build_parser
from tokenloom.engine.async_llm import _ABORTED, EngineDeadError, RequestStream
from tokenloom.fleet.replica import EngineReplica
from tokenloom.fleet.stream_batching import batched_items
from tokenloom.fleet.wire import ACCEPTED, OutputDelta, apply_delta
from tokenloom.outputs import CompletionOutput, RequestOutput
from tokenloom.sampling_params import SamplingParams


def _outputs(n: int) -> list[RequestOutput]:
    """A request's cumulative outputs, one token more each; the last one finished."""
    outs = []
    for i in range(n):
        ids, last = list(range(1, i + 2)), i == n - 1
        choice = CompletionOutput(0, "".join(f"t{t} " for t in ids), ids, "length" if last else None)
        outs.append(RequestOutput("r", None, [7, 8, 9], [choice], finished=last))
    return outs


def _batching(n: int, interval: float):
    """A request of `n` outputs batched at `interval` seconds, its first output already made:
    (stream, outputs, items)."""
    stream, outs = RequestStream("r"), _outputs(n)
    stream.queue.put_nowait(outs[0])
    return stream, outs, batched_items(stream, interval)


async def _next(items, within: float = 5.0):
    """The next item, and how long it took to come."""
    started = time.monotonic()
    item = await asyncio.wait_for(anext(items), within)
    return item, time.monotonic() - started


def test_the_first_output_goes_at_once_and_later_ones_merge_until_the_interval_is_over():
    async def main():
        interval = 0.4
        stream, outs, items = _batching(6, interval)
        first, waited = await _next(items)
        assert first is outs[0] and waited < interval  # whole, and not held for the interval

        async def engine_steps():  # three steps within the interval
            for out in outs[1:4]:
                stream.queue.put_nowait(out)
                await asyncio.sleep(0.02)

        steps = asyncio.create_task(engine_steps())
        merged, waited = await _next(items)
        await steps
        assert waited >= interval  # not before the interval is over
        assert isinstance(merged, OutputDelta) and len(merged.choices[0].token_ids) == 3
        assert apply_delta(outs[0], merged) == outs[3]

    asyncio.run(main())


def test_after_a_quiet_interval_the_next_output_goes_as_it_comes():
    async def main():
        interval = 0.5
        stream, outs, items = _batching(3, interval)
        await _next(items)
        waiting = asyncio.create_task(_next(items))
        await asyncio.sleep(interval + 0.2)  # nothing came within the interval
        put_at = time.monotonic()
        stream.queue.put_nowait(outs[1])
        delta, _ = await waiting
        assert time.monotonic() - put_at < interval / 2  # sent as it came, not an interval later
        assert apply_delta(outs[0], delta) == outs[1]

    asyncio.run(main())


def test_a_held_output_goes_with_the_first_output_after_the_interval_not_on_a_timer():
    """Items leave right after an engine step (one wake-up for every stream), so what is held waits for
    the next output past the interval; a timer fires only once the stream is quiet for a further one."""
    async def main():
        interval = 0.5
        stream, outs, items = _batching(5, interval)
        await _next(items)
        stream.queue.put_nowait(outs[1])  # held
        loop = asyncio.get_running_loop()
        loop.call_later(1.5 * interval, stream.queue.put_nowait, outs[2])  # the next step, past the interval
        merged, waited = await _next(items)
        assert 1.5 * interval <= waited < 2 * interval  # with that step's output, not at the interval
        assert apply_delta(outs[0], merged) == outs[2]
        stream.queue.put_nowait(outs[3])  # then the stream goes quiet: sent on the timer
        quiet, waited = await _next(items)
        assert waited >= 2 * interval - 0.05 and apply_delta(outs[2], quiet) == outs[3]

    asyncio.run(main())


def test_the_final_output_is_never_held_for_the_interval():
    async def main():
        stream, outs, items = _batching(3, 10.0)
        await _next(items)
        stream.queue.put_nowait(outs[1])  # held for the interval...
        asyncio.get_running_loop().call_later(0.05, stream.queue.put_nowait, outs[2])  # ...until the final one
        last, waited = await _next(items)
        assert waited < 5.0 and last.finished and apply_delta(outs[0], last) == outs[2]
        with pytest.raises(StopAsyncIteration):
            await anext(items)

        # Nothing held: the final output right after the first one goes at once too.
        stream, outs, items = _batching(2, 10.0)
        assert (await _next(items))[0] is outs[0]
        stream.queue.put_nowait(outs[1])
        last, waited = await _next(items)
        assert waited < 5.0 and apply_delta(outs[0], last) == outs[1]

    asyncio.run(main())


def test_interval_zero_sends_one_item_per_output():
    async def main():
        stream, outs = RequestStream("r"), _outputs(5)
        items = batched_items(stream, 0.0)
        rebuilt = None
        for out in outs:
            stream.queue.put_nowait(out)
            item, _ = await _next(items)
            rebuilt = item if rebuilt is None else apply_delta(rebuilt, item)
            assert rebuilt == out
            assert rebuilt is out or len(item.choices[0].token_ids) == 1
        with pytest.raises(StopAsyncIteration):
            await anext(items)

    asyncio.run(main())


def test_an_aborted_stream_sends_what_it_held_and_ends():
    async def main():
        stream, outs, items = _batching(4, 10.0)
        await _next(items)
        stream.queue.put_nowait(outs[1])
        asyncio.get_running_loop().call_later(0.05, stream.queue.put_nowait, _ABORTED)
        held, waited = await _next(items)
        assert waited < 5.0 and apply_delta(outs[0], held) == outs[1] and not held.finished
        with pytest.raises(StopAsyncIteration):
            await anext(items)
        assert stream.finished

        stream = RequestStream("r")  # aborted before its first output: nothing
        stream.queue.put_nowait(_ABORTED)
        assert [item async for item in batched_items(stream, 10.0)] == []

    asyncio.run(main())


def test_latest_takes_the_newest_queued_output_or_waits_for_the_next():
    async def main():
        stream, outs = RequestStream("r"), _outputs(4)
        assert await stream.latest(0.01) is None and not stream.finished  # timed out
        stream.queue.put_nowait(outs[0])  # the timed-out wait took nothing: it is there for the next
        stream.queue.put_nowait(outs[1])
        assert await stream.latest(0.01) is outs[1]  # skips ahead: outputs are cumulative
        asyncio.get_running_loop().call_later(0.05, stream.queue.put_nowait, outs[2])
        assert await stream.latest() is outs[2]
        stream.queue.put_nowait(outs[3])
        assert await stream.latest() is outs[3] and stream.finished
        assert await stream.latest() is None

        stream = RequestStream("r")
        stream.queue.put_nowait(_ABORTED)
        assert await stream.latest() is None and stream.finished
        stream = RequestStream("r")
        stream.queue.put_nowait(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await stream.latest()

    asyncio.run(main())


class _FakeEngine:
    """The part of AsyncLLM a replica's `generate` uses: `add` hands out a stream the test feeds."""

    def __init__(self):
        self.stream, self.aborted = RequestStream("r"), []

    async def add(self, request_id, prompt, params, arrival_time=None):
        return self.stream

    def abort(self, request_id):
        self.aborted.append(request_id)


class _Replica(EngineReplica):
    def __del__(self):  # Serve awaits the real one to stop the engine; there is none here
        pass


def _replica(interval_s: float) -> EngineReplica:
    replica = _Replica.__new__(_Replica)  # no engine, no Ray: only what `generate` reads
    replica.async_llm, replica._by_front, replica.prefixes = _FakeEngine(), {}, None
    replica._reporter = "started"  # `_start` has nothing to start
    replica.stream_interval_s = interval_s
    return replica


def _request() -> dict:
    return {"request_id": "r", "prompt_token_ids": [7, 8, 9], "params": SamplingParams(), "sent_at": time.time(),
            "front": "ingress-1"}


def test_a_caller_cancelled_while_its_replica_holds_output_for_the_interval_aborts_the_request():
    async def main():
        replica, outs, got = _replica(10.0), _outputs(5), []

        async def caller():  # Ray Serve's side of the streaming call
            async for item in replica.generate(_request()):
                got.append(item)

        call = asyncio.create_task(caller())
        replica.async_llm.stream.queue.put_nowait(outs[0])
        while len(got) < 2:
            await asyncio.sleep(0.01)
        replica.async_llm.stream.queue.put_nowait(outs[1])
        await asyncio.sleep(0.05)  # the replica now waits out the interval, holding outs[1]
        assert got == [ACCEPTED, outs[0]] and replica._by_front == {"ingress-1": {"r"}}
        call.cancel()  # the caller went away: Ray cancels the replica's generator
        with pytest.raises(asyncio.CancelledError):
            await call
        assert replica.async_llm.aborted == ["r"] and replica._by_front == {}

    asyncio.run(main())


def test_a_replica_streams_a_finished_request_batched_and_does_not_abort_it():
    async def main():
        replica, outs = _replica(0.3), _outputs(6)
        call = replica.generate(_request())
        replica.async_llm.stream.queue.put_nowait(outs[0])
        assert [await anext(call), await anext(call)] == [ACCEPTED, outs[0]]
        for out in outs[1:]:  # the rest of the request is made before the interval is over
            replica.async_llm.stream.queue.put_nowait(out)
        rest = [item async for item in call]
        assert len(rest) == 1 and apply_delta(outs[0], rest[0]) == outs[-1]
        assert replica.async_llm.aborted == [] and replica._by_front == {}

    asyncio.run(main())


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "1e9", "fast"])
def test_a_bad_stream_batching_interval_is_refused_at_start_up(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--stream-batching-interval-ms", value])
    assert "--stream-batching-interval-ms: must be a number of milliseconds from 0 to 10000" in capsys.readouterr().err


def test_the_stream_batching_interval_defaults_to_ray_serve_llms():
    parse = build_parser().parse_args
    assert parse(["serve"]).stream_batching_interval_ms == 50.0
    assert parse(["serve", "--stream-batching-interval-ms", "0"]).stream_batching_interval_ms == 0.0
