"""Stream batching at a fleet replica (fleet/stream_batching.py), the stream's `latest` it is built on
(engine/async_llm.py), a replica's `generate` around it when its caller goes away, and the flag:
pure Python and asyncio with short real intervals, no Ray, no model.

The timings assert only what holds on a loaded machine: an item that must wait for the interval is never
early, and one that must not wait comes long before the interval (seconds) would have let it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from tokenloom.cli import build_parser
from tokenloom.engine.async_llm import _ABORTED, EngineDeadError, RequestStream
from tokenloom.fleet.client import FleetClient, ModelFacts
from tokenloom.fleet.outbox import Outbox
from tokenloom.fleet.replica import EngineReplica
from tokenloom.fleet.stream_batching import batched_items
from tokenloom.fleet.wire import ENDED, GONE, Accepted, OutputDelta, apply_delta
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
    """The part of AsyncLLM a replica's `generate` uses: `add` hands out a stream the test feeds (`stream`:
    request "r"'s, or the last one's)."""

    def __init__(self):
        self.stream, self.aborted = RequestStream("r"), []
        self.streams = {"r": self.stream}

    async def add(self, request_id, prompt, params, arrival_time=None):
        self.stream = self.streams.setdefault(request_id, RequestStream(request_id))
        return self.stream

    def abort(self, request_id):
        self.aborted.append(request_id)


class _Replica(EngineReplica):
    def __del__(self):  # Serve awaits the real one to stop the engine; there is none here
        pass


def _replica(interval_s: float) -> EngineReplica:
    replica = _Replica.__new__(_Replica)  # no engine, no Ray: only what `generate` reads
    replica.async_llm, replica._by_front, replica.prefixes = _FakeEngine(), {}, None
    replica._outboxes, replica.replica_id = {}, "replica-1"
    replica._reporter = "started"  # `_start` has nothing to start
    replica.stream_interval_s = interval_s
    return replica


def _request(request_id: str = "r") -> dict:
    return {"request_id": request_id, "prompt_token_ids": [7, 8, 9], "params": SamplingParams(), "sent_at": time.time(),
            "front": "ingress-1"}


def test_a_caller_cancelled_while_its_replica_holds_output_for_the_interval_aborts_the_request():
    async def main():
        replica, outs, got = _replica(10.0), _outputs(5), []

        async def caller():  # Ray Serve's side of the request's own call
            async for item in replica.generate(_request()):
                got.append(item)

        call = asyncio.create_task(caller())
        mailbox = replica.mailbox("ingress-1", "replica-1")
        replica.async_llm.stream.queue.put_nowait(outs[0])
        assert await asyncio.wait_for(anext(mailbox), 5) == [("r", outs[0])]
        replica.async_llm.stream.queue.put_nowait(outs[1])
        await asyncio.sleep(0.05)  # the replica now waits out the interval, holding outs[1]
        assert got == [Accepted("replica-1")] and replica._by_front == {"ingress-1": {"r"}}
        call.cancel()  # the caller went away: Ray cancels the replica's generator
        with pytest.raises(asyncio.CancelledError):
            await call
        assert replica.async_llm.aborted == ["r"] and replica._by_front == {}

    asyncio.run(main())


def test_a_replica_sends_a_finished_requests_outputs_on_the_mailbox_and_ends_its_call():
    async def main():
        replica, outs = _replica(0.3), _outputs(6)
        call = replica.generate(_request())
        mailbox = replica.mailbox("ingress-1", "replica-1")
        replica.async_llm.stream.queue.put_nowait(outs[0])
        assert await anext(call) == Accepted("replica-1")
        rest = asyncio.create_task(_collect(call))  # the request's own call carries nothing more
        assert await asyncio.wait_for(anext(mailbox), 5) == [("r", outs[0])]
        for out in outs[1:]:  # the rest of the request is made before the interval is over
            replica.async_llm.stream.queue.put_nowait(out)
        [(request_id, delta)] = await asyncio.wait_for(anext(mailbox), 5)
        assert request_id == "r" and apply_delta(outs[0], delta) == outs[-1]
        assert await asyncio.wait_for(rest, 5) == []
        assert replica.async_llm.aborted == [] and replica._by_front == {}

    asyncio.run(main())


def test_a_request_aborted_at_its_replica_ends_with_ended():
    async def main():
        replica = _replica(0.0)
        call = replica.generate(_request())
        mailbox = replica.mailbox("ingress-1", "replica-1")
        assert await anext(call) == Accepted("replica-1")
        rest = asyncio.create_task(_collect(call))
        replica.async_llm.stream.queue.put_nowait(_ABORTED)  # the replica is stopping
        assert await asyncio.wait_for(anext(mailbox), 5) == [("r", ENDED)]
        assert await asyncio.wait_for(rest, 5) == []

    asyncio.run(main())


def test_a_mailbox_call_that_reaches_another_replica_is_told_that_one_is_gone():
    async def main():
        assert await _collect(_replica(0.0).mailbox("ingress-1", "replica-9")) == [GONE]

    asyncio.run(main())


async def _collect(items) -> list:
    return [item async for item in items]


def test_an_outbox_sends_what_one_turn_of_the_loop_put_as_one_batch():
    async def main():
        outbox = Outbox()
        batches = outbox.batches(10.0)
        for request_id in "abc":  # an engine step's outputs, delivered in one callback
            outbox.put(request_id, request_id.upper())
        assert await asyncio.wait_for(anext(batches), 5) == [("a", "A"), ("b", "B"), ("c", "C")]
        outbox.put("a", "A2")
        await asyncio.sleep(0)
        outbox.put("b", "B2")  # a later turn: the consumer may take it with the first or after it
        got = await asyncio.wait_for(anext(batches), 5)
        if got == [("a", "A2")]:
            got += await asyncio.wait_for(anext(batches), 5)
        assert got == [("a", "A2"), ("b", "B2")]

    asyncio.run(main())


def test_a_newer_consumer_of_an_outbox_ends_the_older():
    async def main():
        outbox = Outbox()
        older = outbox.batches(10.0)
        waiting = asyncio.create_task(anext(older))
        await asyncio.sleep(0.01)
        newer = outbox.batches(10.0)
        taking = asyncio.create_task(anext(newer))
        await asyncio.sleep(0.01)
        outbox.put("a", 1)
        assert await asyncio.wait_for(taking, 5) == [("a", 1)]
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 5)

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


class _FakeCall:
    """A streaming call as a Ray Serve handle returns it, over a replica method's generator."""

    def __init__(self, items, lost: BaseException | None = None):
        self.items, self.lost, self.cancelled = items, lost, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.lost is not None:
            raise self.lost
        return await anext(self.items)

    def cancel(self):
        self.cancelled = True


class _FakeHandle:
    """The engine deployment's handle, every call going to `replicas[0]` (popped when `lose` says so)."""

    def __init__(self, *replicas):
        self.replicas, self.calls = list(replicas), []
        self.generate = SimpleNamespace(remote=lambda payload: self._call("generate", payload))
        self.mailbox = SimpleNamespace(remote=lambda front, replica: self._call("mailbox", front, replica))

    def options(self, **_):
        return self

    def _call(self, method, *args):
        call = _FakeCall(getattr(self.replicas[0], method)(*args))
        self.calls.append((method, call))
        return call


def _fleet_client(*replicas) -> FleetClient:
    facts = ModelFacts(max_model_len=64, vocab_size=100, block_size=16, num_kv_blocks=8)
    return FleetClient(_FakeHandle(*replicas), tokenizer=None, facts=facts, notice_board=None, front="ingress-1")


def test_a_front_gets_every_requests_outputs_on_one_mailbox_call_and_a_cancel_touches_no_other():
    async def main():
        replica = _replica(0.0)
        client = _fleet_client(replica)
        a = await client.add("a", [7, 8, 9], SamplingParams())
        b = await client.add("b", [7, 8, 9], SamplingParams())
        outs = {rid: [dataclasses.replace(o, request_id=rid) for o in _outputs(4)] for rid in "ab"}
        got_a, got_b = aiter(a), aiter(b)
        for i in range(2):  # two engine steps, both requests in each
            for rid in "ab":
                replica.async_llm.streams[rid].queue.put_nowait(outs[rid][i])
            assert [await anext(got_a), await anext(got_b)] == [outs["a"][i], outs["b"][i]]
        client.abort("b")  # b's client went away
        for out in outs["a"][2:]:
            replica.async_llm.streams["a"].queue.put_nowait(out)
            assert await anext(got_a) == out
        assert a.finished
        assert sorted(m for m, _ in client.handle.calls) == ["generate", "generate", "mailbox"]
        b_call = client.handle.calls[1]
        assert b_call[0] == "generate" and b_call[1].cancelled  # Ray then aborts b at the replica

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_stream_whose_reader_goes_away_is_cancelled_at_its_replica():
    """As the server's route does when its client vanishes: the output iterator closes first, then the
    route aborts the request by id. The request's call must be cancelled either way."""
    async def main():
        replica = _replica(0.0)
        client = _fleet_client(replica)
        stream = await client.add("a", [7, 8, 9], SamplingParams())
        outputs = aiter(stream)
        replica.async_llm.streams["a"].queue.put_nowait(_outputs(4)[0])
        await anext(outputs)
        await outputs.aclose()  # the client went away mid-stream
        client.abort("a")
        call = client.handle.calls[0]
        assert call[0] == "generate" and call[1].cancelled  # Ray then aborts it at the replica
        assert not client._streams

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_replica_lost_before_the_first_output_sends_the_request_to_another_after_it_an_error():
    async def main():
        lost, other = _replica(0.0), _replica(0.0)
        other.replica_id = "replica-2"
        client = _fleet_client(lost, other)
        stream = await client.add("r", [7, 8, 9], SamplingParams())
        client.handle.replicas.pop(0)  # the replica dies: its calls fail
        for _, call in client.handle.calls:
            call.lost = RayActorError()
        outs = _outputs(2)
        for out in outs:
            other.async_llm.stream.queue.put_nowait(out)
        assert [out async for out in stream][-1] == outs[-1]  # sent again, to the other replica
        assert sorted(m for m, _ in client.handle.calls) == ["generate", "generate", "mailbox", "mailbox"]

        stream = await client.add("s", [7, 8, 9], SamplingParams())
        other.async_llm.stream.queue.put_nowait(_outputs(3)[0])
        items = aiter(stream)
        await anext(items)
        for _, call in client.handle.calls[4:]:  # the other replica dies after the first output
            call.lost = RayActorError()
        mailbox = next(call for method, call in client.handle.calls[2:] if method == "mailbox")
        mailbox.lost = RayActorError()
        other.async_llm.stream.queue.put_nowait(_outputs(3)[1])  # the mailbox's read after this one fails
        with pytest.raises(EngineDeadError, match="lost"):
            async for _ in items:
                pass

    asyncio.run(asyncio.wait_for(main(), 10))


def test_an_outbox_consumer_ends_once_no_request_has_used_it_for_its_idle_time():
    async def main():
        outbox = Outbox()
        outbox.requests = 1
        batches = outbox.batches(0.05)
        waiting = asyncio.create_task(anext(batches))
        await asyncio.sleep(0.2)  # idle time passed, but a request is running
        assert not waiting.done()
        outbox.put("a", 1)
        assert await asyncio.wait_for(waiting, 5) == [("a", 1)]
        outbox.requests = 0
        started = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(batches), 5)
        assert time.monotonic() - started >= 0.05

    asyncio.run(main())
