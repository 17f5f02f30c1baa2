"""One engine replica of a fleet: the engine `tokenloom serve` runs, as a Ray Serve deployment replica.

The class is plain Python; app.py makes it a deployment. The front calls:
- `generate` (streaming): `Accepted` (naming this replica) or a `Refusal`, and nothing more: the call
  stays open while the request runs and raises its error. Its outputs, the first whole and
  `OutputDelta`s after it (wire.py), at most one per `--stream-batching-interval-ms` but the last (Ray
  costs CPU per streamed item: what the engine makes within the interval goes as one delta,
  stream_batching.py), go into its front's outbox. If the caller goes away, Ray cancels the generator
  and the request is aborted at once (its KV blocks freed). If the caller's process dies, Ray does not:
  every second the replica aborts the requests of a front (an ingress replica) that no longer exists.
  With disaggregated prefill it first imports the prompt's K/V that a prefill replica's `prefill`
  computed (into the prefix cache: the request starts from a cache hit).
- `mailbox` (streaming), once per front: the outbox's batches, what all of that front's requests here
  made in one turn of the loop as one item (outbox.py), rather than an item per request.
- `prefill` (on a prefill replica): the prompt's K/V, whole blocks.
Ray Serve calls `check_health`, which raises while the engine is dead or stalled, so Ray takes the
replica out of rotation and starts a new one (a fatal engine error exits the process, AsyncLLM's
`exit_on_fatal`, which Ray also replaces). Every second the replica posts its load (what the router
ranks by), the engine's health and its Prometheus text to the fleet's board (board.py); a replica
routed to by prefix (`report_cached_prefixes`) adds which prompt prefixes its cache still holds
(prefix_summary.py), so that a router that restarts finds the replicas' cached work again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from contextlib import aclosing

from ..engine.step_log import replica_path
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from . import ray_env  # noqa: F401  (before Ray, imported in the functions below: its pacing)
from .board import REPORT_PERIOD_S
from .outbox import Outbox
from .prefix_summary import PrefixSummary
from .stream_batching import batched_items
from .wire import ENDED, GONE, REFUSALS, Accepted, Refusal

logger = logging.getLogger("tokenloom.fleet")
REFUSED = tuple(REFUSALS.values())
STATS_TIMEOUT_S = 5.0
MAILBOX_IDLE_S = 2.0  # a stopping replica waits for its calls to end: a front's idle mailbox ends after this


class EngineReplica:
    def __init__(self, engine_args: dict, board, report_cached_prefixes: bool = False):
        from ..config import engine_config_from_args
        from ..model import catalog
        from ..server.loading import load_served_engine

        args = argparse.Namespace(**engine_args)
        if args.record_steps:  # one file per replica
            args.record_steps = replica_path(args.record_steps, str(os.getpid()))
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = engine_config_from_args(args)
        for source, field in ((config.model, "model"), (config.draft_model, "speculative_config.model")):
            catalog.pull_missing(catalog.missing_pull(source, field))
        served = load_served_engine(args, config)
        self.async_llm, self.metrics = served.async_llm, served.metrics
        self.board = board
        self.stream_interval_s = args.stream_batching_interval_ms / 1000.0
        self._by_front: dict[str, set[str]] = {}  # a front's actor name -> its requests running here
        self._outboxes: dict[str | None, Outbox] = {}  # per front (None: the driver), its requests' outputs
        self.replica_id = _replica_id()
        self.prefixes = PrefixSummary(config.block_size) if report_cached_prefixes else None
        self._reporter: asyncio.Task | None = None

    def _start(self) -> None:
        # The engine thread posts outputs to the loop that started it: Serve's replica loop, which
        # runs the methods below (it does not exist yet in __init__).
        if self._reporter is None:
            self.async_llm.start()
            self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def _report_forever(self) -> None:
        while True:
            try:
                await self.board.post(self.replica_id, await self.report())
            except Exception as exc:  # noqa: BLE001 - the store being unreachable must not stop the replica
                logger.warning("could not post to the fleet board: %r", exc)
            await self._abort_orphans()
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _abort_orphans(self) -> None:
        """A front's process died (the ingress replica under `serve run`; Ray Serve starts another):
        Ray does not end the streaming calls it made, so its requests would generate on, for nobody,
        to their max_tokens. Abort them."""
        if not self._by_front:
            return
        try:
            live = await asyncio.to_thread(_live_actor_names)
        except Exception as exc:  # noqa: BLE001 - Ray's GCS busy: ask again next time
            logger.warning("could not list the cluster's actors: %r", exc)
            return
        for front, request_ids in list(self._by_front.items()):
            if front not in live:
                logger.warning("front %s is gone: aborting its %d request(s)", front, len(request_ids))
                for rid in list(request_ids):
                    self.async_llm.abort(rid)
                self._outboxes.pop(front, None)

    async def describe(self) -> dict:
        """What the ingress needs to know about the model it fronts."""
        engine = self.async_llm.engine
        return {"max_model_len": self.async_llm.config.max_model_len, "vocab_size": engine.model_config.vocab_size,
                "block_size": self.async_llm.config.block_size, "num_kv_blocks": engine.kv.prefix_capacity}

    async def prefill(self, request: dict):
        """Disaggregated prefill: compute the prompt's K/V here (a one-token request), and return the
        whole blocks of it, {"tokens": n, "kv": tensor}, for a decode replica's `generate` to import;
        or a Refusal."""
        self._start()
        ids, salt = request["prompt_token_ids"], request["params"].cache_salt
        try:
            stream = await self.async_llm.add(f"{request['request_id']}-prefill", {"prompt_token_ids": ids},
                                              SamplingParams(max_tokens=1, cache_salt=salt))
        except REFUSED as exc:
            return Refusal.of(exc)
        async for _ in stream:
            pass
        self._computed(ids, salt)
        tokens, kv = await self.async_llm.call_on_engine(lambda engine: engine.export_prefix_kv(ids, salt))
        return {"tokens": tokens, "kv": kv}

    async def generate(self, request: dict, prefilled=None):
        """`prefilled`: a prefill replica's `prefill` result for this prompt (disaggregated serving)."""
        self._start()
        if isinstance(prefilled, Refusal):
            yield prefilled
            return
        if prefilled is not None and prefilled["kv"] is not None:
            ids, kv, salt = request["prompt_token_ids"], prefilled["kv"], request["params"].cache_salt
            await self.async_llm.call_on_engine(lambda engine: engine.import_prefix_kv(ids, kv, salt))
        elapsed = max(0.0, time.time() - request["sent_at"])  # time already spent at the ingress
        rid = request["request_id"]
        try:
            stream = await self.async_llm.add(rid, {"prompt_token_ids": request["prompt_token_ids"]},
                                              request["params"], time.monotonic() - elapsed)
        except REFUSED as exc:  # travels back as data, raised again as itself at the ingress
            yield Refusal.of(exc)
            return
        front = request.get("front")
        if front is not None:
            self._by_front.setdefault(front, set()).add(rid)
        outbox = self._outbox(front)
        outbox.requests += 1  # its mailbox call stays open from now on
        try:
            yield Accepted(self.replica_id)
            async for item in self._items(request, stream):
                outbox.put(rid, item)
        finally:
            outbox.requests -= 1
            if not stream.finished:  # the ingress went away (client gone) or was cancelled
                self.async_llm.abort(rid)
            if front is not None:
                self._by_front[front].discard(rid)
                if not self._by_front[front]:
                    del self._by_front[front]

    async def mailbox(self, front: str | None, replica_id: str):
        """The front's one call here for its requests' outputs (outbox.py), batches of (request id, item),
        for as long as the front lives. Routed to `replica_id` by ray_router.py; a call that reaches
        another replica (that one is gone) gets `GONE` alone. A newer mailbox call of the front takes over;
        it ends once the front has had nothing here for MAILBOX_IDLE_S (the front calls again when it
        has)."""
        if replica_id != self.replica_id:
            yield GONE
            return
        outbox = self._outbox(front)
        async for batch in outbox.batches(MAILBOX_IDLE_S):
            yield batch
        if outbox.idle and self._outboxes.get(front) is outbox:
            del self._outboxes[front]

    def _outbox(self, front: str | None) -> Outbox:
        if front not in self._outboxes:
            self._outboxes[front] = Outbox()
        return self._outboxes[front]

    async def _items(self, request: dict, stream):
        """The request's wire items (stream_batching.py), `ENDED` after them if it ended unfinished
        (aborted here: the replica is stopping)."""
        finished = False
        async with aclosing(batched_items(stream, self.stream_interval_s)) as items:
            async for item in items:
                if isinstance(item, RequestOutput):  # the first output: the prompt's K/V is computed
                    self._computed(request["prompt_token_ids"], request["params"].cache_salt)
                finished = item.finished
                yield item
        if not finished:
            yield ENDED

    def _computed(self, prompt_ids: list[int], salt: str | None) -> None:
        if self.prefixes is not None:
            self.prefixes.computed(prompt_ids, salt)

    async def report(self) -> dict:
        st, held, problem = None, None, self.async_llm.health_problem()
        keys, mark = self.prefixes.snapshot() if self.prefixes is not None else ([], 0)

        def read(engine):
            return engine.stats(), [key in engine.kv.cached for key in keys]

        if problem is None:
            try:  # read between two steps, on the engine thread
                st, held = await asyncio.wait_for(self.async_llm.call_on_engine(read), STATS_TIMEOUT_S)
            except TimeoutError:
                problem = f"the engine thread did not answer within {STATS_TIMEOUT_S:.0f} s"
        report = {
            "waiting": st.num_waiting if st else 0,
            "running": st.num_running if st else 0,
            "kv_usage": st.kv_usage if st else 0.0,
            "health_problem": problem,
            "metrics": self.metrics.render().decode(),
        }
        if self.prefixes is not None:  # what it still caches, as the router hashes prompts
            report["cached_prefixes"] = self.prefixes.report(keys, mark, held) if held is not None else []
        return report

    async def check_health(self) -> None:
        self._start()
        if (problem := self.async_llm.health_problem()) is not None:
            raise RuntimeError(problem)

    async def __del__(self):
        # Serve calls an async __del__ when it stops the replica: finish the engine thread cleanly.
        await self.async_llm.shutdown(0.0)


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def _live_actor_names() -> set[str]:
    """The names of the cluster's live named actors, in every namespace (a dead actor's name is
    released; Ray Serve names each replica's actor)."""
    from ray.util import list_named_actors

    return {actor["name"] for actor in list_named_actors(all_namespaces=True)}
