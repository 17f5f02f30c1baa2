"""The ingress's engine: an AsyncLLM look-alike whose requests run on the fleet's replicas.

The server's routes (tokenloom/server) take an object with AsyncLLM's surface: `add` returning a
stream of cumulative outputs, `abort`, `health_problem`, `config`, `tokenizer`, `engine`. `FleetClient`
is that object for a fleet: `add` makes a streaming call to the engine deployment (Ray Serve's router,
ray_router.py, picks the replica), waits for the replica's word that it took the request (so a refusal
is an HTTP error before any byte is sent, as in one process), and returns a `RemoteStream` that rebuilds
cumulative outputs from the replica's deltas (wire.py). The outputs of all its requests at a replica
come on one call, the front's mailbox there (outbox.py): one Ray item per engine step, not per request.

A replica that dies before the request's first token is tried once more on another replica; after
a token was sent, the request ends with an `EngineDeadError` (a 503 body, or an SSE error event):
never silently.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

from . import ray_env  # noqa: F401  (before Ray: Ray Serve reads its pacing when imported)

# isort: split
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from ..engine.async_llm import EngineDeadError, EngineStoppingError, QueueFullError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from . import board
from .wire import ENDED, GONE, Accepted, OutputDelta, Refusal, apply_delta

logger = logging.getLogger("tokenloom.fleet")


class ReplicaGone(Exception):
    """A replica's mailbox call reached another replica (wire.GONE): the one it named is gone."""


REPLICA_LOST = (RayActorError, ActorUnavailableError, ReplicaGone)
MAX_SENDS = 2  # a request lost with its replica before any token goes to one more


@dataclass
class ModelFacts:
    """What a replica's `describe()` says about the model (the ingress loads no weights)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int


class RemoteStream:
    """One request's outputs from its replica, cumulative, like AsyncLLM's RequestStream. They come on
    the front's mailbox call to that replica (FleetClient._read_mailbox); the request's own call says only
    that the replica took it, and raises if the request fails there or the replica is lost."""

    def __init__(self, client: FleetClient, request_id: str, payload: dict):
        self.client, self.request_id, self.payload = client, request_id, payload
        self.finished = False
        self.replica: str | None = None
        self.received = False  # an output came: the request is never sent again
        self._items: asyncio.Queue = asyncio.Queue()  # outputs, ENDED, or a _Lost
        self._call = None
        self._watcher: asyncio.Task | None = None
        self._sends = 0

    def _send(self):
        """One call to a replica. With disaggregated prefill, a prefill replica computes the prompt's K/V
        first; its result goes to the decode replica as an argument, through Ray's object store."""
        self._sends += 1
        self.payload["sent_at"] = time.time()
        if self.client.prefill_handle is None:
            return self.client.handle.generate.remote(self.payload)
        prefilled = self.client.prefill_handle.prefill.remote(self.payload)
        return self.client.handle.generate.remote(self.payload, prefilled)

    def _resend_or_raise(self, exc: BaseException) -> None:
        """The replica was lost: the request may go to another one (once, and only before any token),
        else it ends with an error."""
        if self._sends < MAX_SENDS:
            logger.warning("request %s: its replica was lost before the first token (%s); sending it to another",
                           self.request_id, type(exc).__name__)
            return
        self.finished = True
        raise EngineDeadError(f"the replica serving this request was lost ({type(exc).__name__}); retry the "
                              "request") from None

    async def open(self) -> None:
        """Send the request; returns once a replica took it, raises its refusal otherwise."""
        while True:
            try:
                self._call = self._send()
                first = await self._call.__anext__()
                break
            except BackPressureError as exc:  # Ray's queue in front of the replicas is full
                self.finished = True
                raise QueueFullError(f"every replica's queue is full: {exc}") from None
            except REPLICA_LOST as exc:
                self._resend_or_raise(exc)
        if isinstance(first, Refusal):
            self.finished = True
            raise first.exception()
        if not isinstance(first, Accepted):
            raise TypeError(f"a replica answered {first!r} instead of accepting or refusing")
        self.replica = first.replica
        self.client.open_mailbox(first.replica)
        self._watcher = asyncio.get_running_loop().create_task(self._watch(self._call, self._sends))

    async def _watch(self, call, send: int) -> None:
        """The rest of the request's own call: nothing, unless it fails."""
        try:
            async for item in call:
                raise TypeError(f"a replica sent {type(item).__name__} on a request's own call")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the replica lost, or the request's error there
            self.lost(exc, send)

    def receive(self, item) -> None:
        self.received = True
        self._items.put_nowait(item)

    def lost(self, error: BaseException, send: int | None = None) -> None:
        """Its call failed, or the mailbox call its outputs came on (`send`: the attempt it concerns)."""
        self._items.put_nowait(_Lost(error, self._sends if send is None else send))

    async def __aiter__(self):
        out: RequestOutput | None = None
        while not self.finished:
            item = await self._items.get()
            if isinstance(item, _Lost):
                if item.send != self._sends:  # news of an earlier attempt's replica
                    continue
                if not isinstance(item.error, REPLICA_LOST):
                    self.finished = True
                    raise item.error
                if self.received:
                    self._sends = MAX_SENDS  # tokens were sent: never again
                self._resend_or_raise(item.error)
                self.replica = None  # what its mailbox says from now on is not about this request
                await self.open()
                continue
            if item == ENDED:  # aborted by the replica (it is shutting down)
                self.finished = True
                return
            if isinstance(item, OutputDelta):
                out = apply_delta(out, item)
            elif isinstance(item, RequestOutput):
                out = item
            else:
                raise TypeError(f"a replica sent {type(item).__name__} where an output was expected")
            if out.finished:
                self.finished = True
            yield out

    def cancel(self) -> None:
        if self._call is not None and not self.finished:
            self.finished = True
            self._call.cancel()  # Ray cancels the replica's generator, which aborts the request
        if self._watcher is not None:
            self._watcher.cancel()


@dataclass
class _Lost:
    """A request's call, or the mailbox call of its replica, failed (on its attempt `send`)."""

    error: BaseException
    send: int


class FleetClient:
    def __init__(self, handle, tokenizer, facts: ModelFacts, notice_board, prefill_handle=None,
                 front: str | None = None):
        """`handle`: the engine deployment's handle; `notice_board`: the fleet's board (board.py);
        `prefill_handle`: the prefill deployment's, for disaggregated prefill (else None); `front`: the
        name of the Ray actor this runs in, which every request carries, so a replica can stop
        the requests of a front that died (replica.py); None where the front is the Ray driver, which
        takes the fleet down with it."""
        self.front = front
        # Streams over Serve's gRPC channel to the replica (by value), not as Ray objects: each streamed item
        # is then one message rather than an object stored and reported through Ray's core, less CPU on
        # both sides. Disaggregated prefill hands the prompt's K/V to `generate` as a Ray object: by reference.
        self.handle = handle.options(stream=True, _by_reference=prefill_handle is not None)
        self.notice_board = notice_board
        self.prefill_handle = prefill_handle
        self.tokenizer = tokenizer
        self.facts = facts
        self.config = SimpleNamespace(max_model_len=facts.max_model_len, block_size=facts.block_size)
        self.engine = _IngressModel(tokenizer, facts.vocab_size)
        self._board_reader: asyncio.Task | None = None
        self._streams: dict[str, RemoteStream] = {}
        self._mailboxes: dict[str, asyncio.Task] = {}  # replica id -> the reader of its mailbox call
        self._stopping = False

    # The app's lifespan calls these; the replicas' own lifecycles are Ray Serve's.
    def start(self) -> None:
        if self._board_reader is None:
            self._board_reader = asyncio.get_running_loop().create_task(self._read_board_forever())

    async def _read_board_forever(self) -> None:
        """The replicas' reports into board.LATEST, which this process's router and /metrics read."""
        while True:
            await board.refresh(self.notice_board)
            await asyncio.sleep(board.REPORT_PERIOD_S)

    async def shutdown(self, timeout: float = 0.0) -> None:
        self._stopping = True
        if self._board_reader is not None:
            self._board_reader.cancel()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            stream.cancel()
        for mailbox in list(self._mailboxes.values()):
            mailbox.cancel()

    def health_problem(self) -> str | None:
        """None while at least one replica reports itself healthy (or none has reported yet)."""
        stats = board.LATEST
        problems = [s.get("health_problem") for s in stats.values()]
        if not stats or any(p is None for p in problems):
            return None
        return "no healthy replica: " + "; ".join(sorted(set(problems)))

    async def add(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                  lora_request=None) -> RemoteStream:
        if self._stopping:
            raise EngineStoppingError("the server is shutting down")
        if lora_request is not None:
            raise ValueError("model: LoRA adapters are not served by a fleet (--data-parallel-size) yet")
        ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        if params.structured_outputs is not None:  # the compiled grammar stays here; the replica compiles its own
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(params.structured_outputs))
        stream = RemoteStream(self, request_id, {"request_id": request_id, "prompt_token_ids": ids, "params": params,
                                                 "front": self.front})
        self._streams[request_id] = stream
        try:
            await stream.open()
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return _Tracked(stream, lambda: self._streams.pop(request_id, None))

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    def open_mailbox(self, replica: str) -> None:
        """The call on which `replica` sends this front's outputs (outbox.py), once per replica."""
        if replica not in self._mailboxes:
            # In a context of its own: inside a Ray Serve ingress, the request being served would be its
            # parent, and Ray cancels a request's child calls with it (the client that opened it vanishing
            # would end every other stream's outputs there).
            self._mailboxes[replica] = asyncio.get_running_loop().create_task(
                self._read_mailbox(replica), context=contextvars.Context())

    async def _read_mailbox(self, replica: str) -> None:
        call = self.handle.mailbox.remote(self.front, replica)
        error: BaseException | None = None
        try:
            async for batch in call:
                if batch == GONE:
                    raise ReplicaGone(f"replica {replica} is gone")
                for request_id, item in batch:
                    if (stream := self._streams.get(request_id)) is not None:  # else gone already: dropped
                        stream.receive(item)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - the replica lost, or the call reached another
            error = exc
        finally:
            del self._mailboxes[replica]
        waiting = [s for s in self._streams.values() if s.replica == replica and not s.finished]
        if error is not None:
            for stream in waiting:
                stream.lost(error)
        elif waiting:  # it ended idle, as a request there was being accepted: call again
            self.open_mailbox(replica)


class _Tracked:
    """A RemoteStream that leaves the client's table when it ends, however it ends."""

    def __init__(self, stream: RemoteStream, done):
        self._stream, self._done = stream, done

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def finished(self) -> bool:
        return self._stream.finished

    async def __aiter__(self):
        try:
            async for out in self._stream:
                yield out
        finally:
            if not self._stream.finished:  # its reader went away (the client did): abort it at the replica
                self._stream.cancel()
            self._done()  # out of the table, so the route's abort by id that follows finds nothing


class _IngressModel:
    """The parts of an engine the routes read at the ingress: the vocabulary size and a grammar compiler
    (so a bad grammar is a 400 here, before any replica sees it). No adapters: see FleetClient.add."""

    adapters = None

    def __init__(self, tokenizer, vocab_size: int):
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self._tokenizer = tokenizer

    @cached_property  # first read on the event loop (the routes pass `grammars.compile` to a thread)
    def grammars(self):
        from ..structured_output.grammar import GrammarCompiler

        return GrammarCompiler(self._tokenizer, self.model_config.vocab_size)
