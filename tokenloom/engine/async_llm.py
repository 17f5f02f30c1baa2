"""AsyncLLM: one LLMEngine driven by one dedicated thread, with an async output stream per request.

Threading contract (why it is safe):
- Only the engine thread touches the engine. The event loop talks to it through a thread-safe
  command queue (add / abort / stop) that the engine thread drains between steps.
- Outputs travel back through `loop.call_soon_threadsafe` into per-request `asyncio.Queue`s, so the
  event loop never blocks on the model and never shares a data structure with the engine thread.
- `add()` resolves only after the engine thread has run `add_request`, so a validation error
  (prompt too long, bad token ids, full queue) reaches the HTTP handler before any byte is sent.
- When idle the engine thread sleeps on a `threading.Event` (set by every command), never spins.
- A request that fails inside the engine (see llm_engine's fault isolation) ends with an output
  whose `error` is set, like any finished output; the others go on.
- If a step raises (the engine cannot go on: `EngineFatalError`, or anything unexpected), the
  thread records the error, fails every open stream and pending add, and `is_healthy` turns False;
  later calls raise `EngineDeadError`. With `exit_on_fatal` (the server) the process then exits
  with status 1 after a short grace for the error events to go out, so a supervisor restarts it
  instead of a 503 zombie living on.
- `is_healthy` is True only while the thread is alive, has not failed, and no step has been
  running for longer than `stall_timeout_s` (a hung forward).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..model.load import default_num_threads, set_num_threads
from ..model.lora import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .slo_policy import SLOShedError

logger = logging.getLogger("tokenloom.async_llm")

_IDLE_STEP_WAIT_S = 0.001  # a step that scheduled nothing (dynamic batching window): nap, do not spin
FATAL_EXIT_CODE = 1
_FATAL_EXIT_GRACE_S = 0.5  # lets the event loop send the error events before the process exits


class EngineDeadError(RuntimeError):
    """The engine thread stopped with an exception; no request can be served any more."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queue_len` allows; the caller should retry later."""


class EngineStoppingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


_ABORTED = object()  # stream sentinel: the request was aborted, no more outputs will come


class RequestStream:
    """The event-loop side of one request: outputs arrive here from the engine thread."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            out = self._take(await self.queue.get())
            if out is None:
                return
            yield out

    async def latest(self, timeout: float | None = None) -> RequestOutput | None:
        """The newest output, for a consumer that sends outputs on its own schedule (a fleet replica
        batching its stream, fleet/stream_batching.py): at once if one is queued, else the next to
        arrive within `timeout` seconds (None: however long it takes). None if none came in time, or
        once the stream ended (aborted; `finished` tells the two apart). Raises the engine's error,
        as iterating does; iterating and this method take from the same queue."""
        if self.finished:
            return None
        if not self.queue.empty():
            return self._take(self.queue.get_nowait())
        try:
            # A timed-out (or cancelled) Queue.get loses nothing: an output arriving meanwhile stays queued.
            async with asyncio.timeout(timeout):
                item = await self.queue.get()
        except TimeoutError:
            return None
        return self._take(item)

    def _take(self, item) -> RequestOutput | None:
        """What the consumer gets for a queue item: the newest output, None once aborted; the error raised."""
        # Only the newest cumulative output matters: skip ahead if the consumer fell behind.
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()
        if item is _ABORTED:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    future: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: object  # fn(engine) -> value, run on the engine thread between two steps
    future: asyncio.Future


@dataclass
class _Stop:
    aborted: list[str] = field(default_factory=list)


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queue_len: int | None = None,
        metrics=None,
        num_threads: int | None = None,
        exit_on_fatal: bool = False,
        stall_timeout_s: float = 120.0,
        turn=None,
    ):
        """`metrics` is an `EngineMetrics` (or anything with `on_step(engine, stats, outputs)`,
        `on_idle(engine)` and `on_abort(request_id)`); it is called on the engine thread.
        `exit_on_fatal`: end the process (status 1) when the engine cannot go on (the server sets it;
        in-process users get `EngineDeadError`s instead). `turn`: a ForwardTurn (engine/forward_turn.py)
        shared with other engines in the process, taken for each step."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self.num_threads = num_threads
        self.exit_on_fatal = exit_on_fatal
        self.stall_timeout_s = stall_timeout_s
        self.turn = turn
        self._step_started: float | None = None  # monotonic start of the step in progress
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stopping = False
        self._stop_deadline: float | None = None
        self.num_unfinished = 0  # event-loop view: requests added and not yet finished/aborted

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenloom-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """None when the engine thread is alive and stepping, else why not."""
        if self.error is not None:
            return f"the engine stopped: {self.error!r}"
        if self._thread is None or not self._thread.is_alive():
            return "the engine is not running"
        started = self._step_started
        if started is not None and (stuck := time.monotonic() - started) > self.stall_timeout_s:
            return f"the engine is stalled: one step has been running for {stuck:.0f}s"
        return None

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` seconds, abort the rest,
        and stop the engine thread."""
        self._stopping = True
        self._stop_deadline = time.monotonic() + max(timeout, 0.0)
        self._send(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout + 30.0)

    # -- the event-loop API ----------------------------------------------------------------------

    async def add(
        self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it (raises ValueError,
        QueueFullError, EngineDeadError or EngineStoppingError otherwise)."""
        self._check_alive()
        if self._stopping:
            raise EngineStoppingError("the server is shutting down")
        stream = RequestStream(request_id)
        fut = self._loop.create_future()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._send(_Add(request_id, prompt, params, arrival, stream, fut, lora_request))
        if self.error is not None and not fut.done():
            # The thread died after the check above; `_die` sets `error` before draining, so
            # either it drains this add or we see the error here. Never wait forever.
            fut.set_exception(EngineDeadError(f"the engine stopped: {self.error!r}"))
        try:
            await fut
        except asyncio.CancelledError:
            # The caller went away while the add was queued; make sure the engine forgets it.
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes; aborts it if the consumer stops early."""
        stream = await self.add(request_id, prompt, params, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def call_on_engine(self, fn) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between two steps (waking it when idle); the future
        gets its value or exception. For readers of engine state (the dashboard's snapshots), which
        must not walk the engine's structures while a step changes them."""
        self._check_alive()
        fut = self._loop.create_future()
        self._send(_Call(fn, fut))
        return fut

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Thread-safe, returns at once."""
        self._send(_Abort(request_id))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        # torch's intra-op thread count is per calling thread for OpenMP: set it where the model runs.
        set_num_threads(self.num_threads or self.config.num_threads or default_num_threads())
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()  # before draining: a command sent after this wakes the wait below
                self._drain_commands()
                if self._stopping and self._finish_stop():
                    break
                if not engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=1.0 if self._stopping else None)
                    continue
                outputs = self._step()
                self._deliver(outputs)
                if self.metrics is not None:
                    try:
                        self.metrics.on_step(engine, engine.last_step, outputs)
                    except Exception:  # metrics must not take the engine down
                        logger.exception("metrics on_step failed")
                if engine.last_step is not None and engine.last_step.num_seqs == 0:
                    self._wakeup.wait(_IDLE_STEP_WAIT_S)
        except BaseException as exc:
            logger.critical("engine thread died: %r", exc, exc_info=exc)
            self._die(exc)
            if self.exit_on_fatal:
                self._exit_process()

    def _step(self) -> list[RequestOutput]:
        if self.turn is not None:
            self.turn.acquire()  # waiting for the turn is not a stall: the clock starts after it
        try:
            self._step_started = time.monotonic()
            return self.engine.step()
        finally:
            self._step_started = None
            if self.turn is not None:
                self.turn.release()

    def _drain_commands(self) -> None:
        changed = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._do_add(cmd)
            elif isinstance(cmd, _Abort):
                stream = self._streams.pop(cmd.request_id, None)
                if stream is not None:
                    self.engine.abort_request(cmd.request_id)
                    self._post(self._end_stream, stream, _ABORTED)
                    if self.metrics is not None:
                        self.metrics.on_abort(cmd.request_id)
                    changed = True
            elif isinstance(cmd, _Call):
                try:
                    value, exc = cmd.fn(self.engine), None
                except Exception as err:  # noqa: BLE001 - the caller's to handle; the engine goes on
                    value, exc = None, err
                self._post(_settle, cmd.future, value, exc)
        if changed and self.metrics is not None:
            # No step may follow (the engine may now be idle): publish the freed KV blocks now.
            self.metrics.on_idle(self.engine)

    def _do_add(self, cmd: _Add) -> None:
        try:
            if self._stopping:
                raise EngineStoppingError("the server is shutting down")
            if self.max_queue_len is not None and (waiting := self.engine.stats().num_waiting) >= self.max_queue_len:
                raise QueueFullError(
                    f"the queue is full ({waiting} requests waiting, max_queue_len "
                    f"{self.max_queue_len}); retry later"
                )
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.lora_request)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the engine stays up
            if isinstance(exc, SLOShedError) and self.metrics is not None:
                self.metrics.on_idle(self.engine)  # count the refusal now: no step may follow
            self._post(self._resolve, cmd, exc)
            return
        self._streams[cmd.request_id] = cmd.stream
        self._post(self._resolve, cmd, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        if batch:
            self._post(self._put_many, batch)  # one loop wake-up per step, not one per request

    def _finish_stop(self) -> bool:
        """While stopping: True once nothing is left (aborting what outlived the deadline)."""
        if self.engine.has_unfinished_requests() and time.monotonic() < self._stop_deadline:
            return False
        for request_id in list(self._streams):
            self._commands.put(_Abort(request_id))
        self._drain_commands()
        return True

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        err = EngineDeadError(f"the engine stopped: {exc!r}")
        for stream in self._streams.values():
            self._post(self._end_stream, stream, err)
        self._streams.clear()
        while True:  # fail the adds nobody will process
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._post(self._resolve, cmd, err)
            elif isinstance(cmd, _Call):
                self._post(_settle, cmd.future, None, err)

    def _exit_process(self) -> None:
        """The engine cannot go on: exit non-zero so a supervisor restarts the server."""
        time.sleep(_FATAL_EXIT_GRACE_S)
        logger.critical("exiting with status %d so that a supervisor restarts the server", FATAL_EXIT_CODE)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(FATAL_EXIT_CODE)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    # -- callbacks run on the event loop ---------------------------------------------------------

    def _resolve(self, cmd: _Add, exc: BaseException | None) -> None:
        if exc is None:
            self.num_unfinished += 1
        if cmd.future.done():  # the caller was cancelled; its request must not run unobserved
            if exc is None:
                self.abort(cmd.request_id)
            return
        if exc is None:
            cmd.future.set_result(None)
        else:
            cmd.future.set_exception(exc)

    def _put_many(self, batch) -> None:
        for stream, out in batch:
            stream.queue.put_nowait(out)
            if out.finished:
                self.num_unfinished -= 1

    def _end_stream(self, stream: RequestStream, item) -> None:
        stream.queue.put_nowait(item)
        self.num_unfinished -= 1


def _settle(future: asyncio.Future, value, exc: BaseException | None) -> None:
    if not future.done():  # the caller may have given up (cancelled) meanwhile
        if exc is None:
            future.set_result(value)
        else:
            future.set_exception(exc)
