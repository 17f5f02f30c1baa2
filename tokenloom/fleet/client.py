"""The ingress's engine: an AsyncLLM look-alike whose requests run on the fleet's replicas.

The server's routes (tokenloom/server) take an object with AsyncLLM's surface: `add` returning a
stream of cumulative outputs, `abort`, `health_problem`, `config`, `tokenizer`, `engine`. `FleetClient`
is that object for a fleet: `add` makes a streaming call to the engine deployment (Ray Serve's router,
ray_router.py, picks the replica), waits for the replica's word that it took the request (so a refusal
is an HTTP error before any byte is sent, as in one process), and returns a `RemoteStream` that rebuilds
cumulative outputs from the replica's deltas (wire.py).

A replica that dies before the request's first token is tried once more on another replica; after
a token was sent, the request ends with an `EngineDeadError` (a 503 body, or an SSE error event):
never silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

from ray.exceptions import ActorUnavailableError, RayActorError

from ..engine.async_llm import EngineDeadError, EngineStoppingError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .wire import ACCEPTED, OutputDelta, Refusal, apply_delta

logger = logging.getLogger("tokenloom.fleet")

REPLICA_LOST = (RayActorError, ActorUnavailableError)


@dataclass
class ModelFacts:
    """What a replica's `describe()` says about the model (the ingress loads no weights)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int


class RemoteStream:
    """One request's outputs from its replica, cumulative, like AsyncLLM's RequestStream."""

    def __init__(self, client: FleetClient, request_id: str, payload: dict):
        self.client, self.request_id, self.payload = client, request_id, payload
        self.finished = False
        self._call = None
        self._retried = False

    async def open(self) -> None:
        """Send the request; returns once a replica took it, raises its refusal otherwise. With
        disaggregated prefill, a prefill replica computes the prompt's K/V first; its result goes to the
        decode replica as an argument, through Ray's object store (never through here)."""
        self.payload["sent_at"] = time.time()
        if self.client.prefill_handle is None:
            self._call = self.client.handle.generate.remote(self.payload)
        else:
            prefilled = self.client.prefill_handle.prefill.remote(self.payload)
            self._call = self.client.handle.generate.remote(self.payload, prefilled)
        first = await self._call.__anext__()
        if isinstance(first, Refusal):
            self.finished = True
            raise first.exception()
        if first != ACCEPTED:
            raise RuntimeError(f"a replica answered {first!r} instead of accepting or refusing")

    async def __aiter__(self):
        out: RequestOutput | None = None
        while not self.finished:
            try:
                item = await self._call.__anext__()
            except StopAsyncIteration:  # finished, or aborted by the replica (it is shutting down)
                self.finished = True
                return
            except REPLICA_LOST as exc:
                if out is None and not self._retried:
                    self._retried = True
                    logger.warning("request %s: its replica was lost before the first token (%s); trying "
                                   "another once", self.request_id, type(exc).__name__)
                    await self.open()
                    continue
                self.finished = True
                raise EngineDeadError(f"the replica serving this request was lost ({type(exc).__name__}); "
                                      "retry the request") from None
            out = item if isinstance(item, RequestOutput) else apply_delta(out, item) \
                if isinstance(item, OutputDelta) else _unexpected(item)
            if out.finished:
                self.finished = True
            yield out

    def cancel(self) -> None:
        if self._call is not None and not self.finished:
            self.finished = True
            self._call.cancel()  # Ray cancels the replica's generator, which aborts the request


def _unexpected(item) -> RequestOutput:
    raise RuntimeError(f"a replica sent {type(item).__name__} where an output was expected")


class FleetClient:
    def __init__(self, handle, tokenizer, facts: ModelFacts, stats, prefill_handle=None):
        """`handle`: the engine deployment's handle; `stats`: () -> the replicas' latest reports;
        `prefill_handle`: the prefill deployment's, for disaggregated prefill (else None)."""
        self.handle = handle.options(stream=True)
        self.prefill_handle = prefill_handle
        self.tokenizer = tokenizer
        self.facts = facts
        self.config = SimpleNamespace(max_model_len=facts.max_model_len, block_size=facts.block_size)
        self.engine = _IngressModel(tokenizer, facts.vocab_size)
        self._stats = stats
        self._streams: dict[str, RemoteStream] = {}
        self._stopping = False

    # The app's lifespan calls these; the replicas' own lifecycles are Ray Serve's.
    def start(self) -> None:
        pass

    async def shutdown(self, timeout: float = 0.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            stream.cancel()

    def health_problem(self) -> str | None:
        """None while at least one replica reports itself healthy (or none has reported yet)."""
        stats = self._stats()
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
        stream = RemoteStream(self, request_id, {"request_id": request_id, "prompt_token_ids": ids, "params": params})
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
            self._done()


class _IngressModel:
    """The parts of an engine the routes read at the ingress: the vocabulary size and a grammar compiler
    (so a bad grammar is a 400 here, before any replica sees it). No adapters: see FleetClient.add."""

    adapters = None

    def __init__(self, tokenizer, vocab_size: int):
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self._tokenizer = tokenizer

    @cached_property  # first read on the event loop (the routes pass `grammars.compile` to a thread)
    def grammars(self):
        from ..structured_outputs import GrammarCompiler

        return GrammarCompiler(self._tokenizer, self.model_config.vocab_size)
