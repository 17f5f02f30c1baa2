"""One request through a cascade's tiers (issue 55): the small model answers unless it is unsure.

The front (multi_serve.py) hands a request for a cascade's name here, with a way to acquire each tier's
model (loaded, counted in flight until the response is done). Each tier but the last starts the request
exactly as its own model's route would (its view: its tokenizer, chat template, tools, structured
output, the same sampling parameters), asking the engine for the top-N logprobs as well; its first k
tokens (or its whole answer, if shorter) are held while the rule (cascade_config.CascadeRule) judges
their confidence (cascade_signals.py). If the answer stands, the held output and the rest of the same
engine request become the response, streamed live from there; if not, the request is aborted and the
next tier answers the same body from scratch. The last tier runs as a plain request. So a streamed
answer's tokens come from the answering tier only, and the decision is never revised at a long answer's
end: after k tokens the tier is committed.

A tier whose model cannot be loaded, or that refuses the request (a prompt over its context, a grammar
its vocabulary cannot spell: any 4xx of its checks), is skipped (`skipped` in the response names it and
why) and the next answers; with none left the answer is the last tier's error (a 503 naming an
unloadable tier, the 4xx of a bad request). The next tier is acquired while the current one still holds
its answer, so a cascade's tiers are meant to be resident together (the budget should hold them): a next
tier that cannot load beside it (after the set's load wait) leaves the current answer standing. A cascade
answers one choice of one text prompt (`n` > 1, several prompts or token ids: a 400).

The response carries `served_by` (the answering tier's model), `escalated` (a tier after the first
answered, for whatever reason: `skipped` names a tier passed over without a decision), `confidence`
(the last decision's score, of the rule's signal) and `confidence_signals` (every signal of that
decision), `usage` summed over every tier that ran with `usage.tiers` per tier; in a stream, the last
chunk before [DONE] carries them. A probe (a calibration file's) reads the small tier's pooled hidden
state (SamplingParams.pool_hidden): over the prompt alone it decides after the prompt ran (a router: one
token held), over the prompt and the first k tokens at k.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from fastapi import FastAPI, Request
from pydantic import BaseModel

from .cascade_config import CascadeSpec
from .cascade_signals import CONFIDENCE_TOP_N, token_signals
from .chat import ChatView
from .completions import CompletionView
from .errors import APIError, install_error_handlers
from .protocol import ChatCompletionRequest, CompletionRequest
from .streams import RequestGroup

logger = logging.getLogger("tokenloom.server.cascade")


class Tiers(Protocol):
    """The front's hold on tier models (multi_serve.TierAccess)."""

    async def acquire(self, name: str): ...  # the model loaded and held: its ServerState (raises APIError)

    async def release(self, name: str) -> None: ...


class CascadeMetrics:
    """Per cascade: requests, answers per tier, escalations by reason, tokens per tier (in /metrics)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter

        self.registry = CollectorRegistry()
        self.requests = Counter("tokenloom:cascade_requests", "Requests for a cascade.", ["cascade"],
                                registry=self.registry)
        self.answered = Counter("tokenloom:cascade_answered", "Requests a cascade's tier answered.",
                                ["cascade", "tier"], registry=self.registry)
        self.escalations = Counter("tokenloom:cascade_escalations", "Requests passed to the next tier, by reason "
                                   "(low_confidence, tier_unavailable, tier_cannot_serve).", ["cascade", "tier", "reason"],
                                   registry=self.registry)
        self.tokens = Counter("tokenloom:cascade_tokens", "Tokens each tier of a cascade took (prompt) and wrote "
                              "(completion).", ["cascade", "tier", "kind"], registry=self.registry)

    def summary(self) -> dict[str, dict]:
        """Per cascade, the counters as the dashboard shows them: requests, answered per tier,
        escalations per reason, completion tokens per tier."""
        out: dict[str, dict] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # the `_created` timestamps
                labels, value = sample.labels, int(sample.value)
                row = out.setdefault(labels["cascade"], {"requests": 0, "answered": {}, "escalations": {},
                                                         "completion_tokens": {}})
                if family.name == "tokenloom:cascade_requests":
                    row["requests"] += value
                elif family.name == "tokenloom:cascade_answered":
                    row["answered"][labels["tier"]] = value
                elif family.name == "tokenloom:cascade_escalations":
                    row["escalations"][labels["reason"]] = row["escalations"].get(labels["reason"], 0) + value
                elif labels["kind"] == "completion":
                    row["completion_tokens"][labels["tier"]] = value
        return out


@dataclasses.dataclass
class _Run:
    """What one request went through: per tier its tokens and decision."""
    tiers: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    confidence: float | None = None
    signals: dict | None = None
    error: APIError | None = None  # the last tier that could not be acquired
    why: str = "no decision"  # the last decision, for the request's log line

    def record(self, model: str, prompt_tokens: int, completion_tokens: int, **decision) -> None:
        self.tiers.append({"model": model, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           **decision})


class Cascade:
    def __init__(self, spec: CascadeSpec, metrics: CascadeMetrics, log_requests: bool = True):
        self.spec, self.rule, self.metrics, self.log_requests = spec, spec.rule, metrics, log_requests

    async def answer(self, view_cls, body: BaseModel, request: Request, tiers: Tiers):
        if getattr(body, "n", None) not in (None, 1):
            raise APIError(400, f"n: a cascade ({self.spec.name}) answers one choice; ask a tier's model for more",
                           param="n")
        if isinstance(body, CompletionRequest) and not isinstance(body.prompt, str):
            raise APIError(400, f"prompt: a cascade ({self.spec.name}) takes one text prompt (token ids are one "
                           "tier's tokenizer's; several prompts, several requests)", param="prompt")
        self.metrics.requests.labels(self.spec.name).inc()
        run = _Run()
        names = self.spec.tiers
        found = await self._next_tier(tiers, 0, run)
        if found is None:
            raise run.error
        i, state = found
        while True:
            tier = names[i]
            req = body.model_copy(update={"model": tier})
            if i == len(names) - 1:
                view, group = await view_cls.start(req, state, model=self.spec.name)
                return await self._respond(view, group, request, run, tier, i)
            client_n: list[int | None] = []
            try:
                view, group = await view_cls.start(req, state, model=self.spec.name,
                                                   adjust=_with_logprobs(client_n, self.rule.probe is not None))
            except (APIError, ValueError) as exc:
                # This tier cannot take the request (its context, its vocabulary for the grammar, its
                # template): the next one tries; a fault of the request itself is the last tier's answer.
                found = await self._next_tier(tiers, i + 1, run)
                if found is None:
                    raise
                run.skipped.append({"model": tier, "reason": getattr(exc, "message", None) or str(exc)})
                self.metrics.escalations.labels(self.spec.name, tier, "tier_cannot_serve").inc()
                await tiers.release(tier)
                i, state = found
                continue
            held, rest = await _first_tokens(group, self.rule.hold)
            out = held[-1] if held else None
            if out is None or out.error is not None:  # aborted (shutdown) or failed: that tier's own answer
                return await self._respond(view, _HeldGroup(group, held, rest, client_n[0]), request, run, tier, i)
            c = out.outputs[0]
            signals = token_signals(c.token_ids[: self.rule.k], (c.logprobs or [])[: self.rule.k])
            if self.rule.probe is not None:
                pooled = c.prompt_hidden if self.rule.probe_pool == "prompt" else c.pooled_hidden
                signals["probe"] = 1.0 - self.rule.probe.p_fail(pooled) if pooled is not None else 1.0
            confidence = signals[self.rule.signal]
            run.confidence, run.signals = confidence, signals
            threshold = self.rule.current_threshold()
            low = self.rule.escalates(confidence)
            if i == 0:
                self.rule.observe(confidence)
            run.why = f"{tier}: {self.rule.signal} {confidence:.3f} {'<' if low else '>='} {threshold:.4g}"
            # The next tier is acquired before this one is aborted: if none can load, this answer stands.
            found = await self._next_tier(tiers, i + 1, run) if low else None
            if low and found is None:
                run.why += ", but no later tier could load"
            if found is None:
                run.tiers.append({"model": tier, "confidence": round(confidence, 4), "decision": "answered"})
                return await self._respond(view, _HeldGroup(group, held, rest, client_n[0]), request, run, tier, i)
            group.abort_unfinished()
            await tiers.release(tier)  # the next tier may evict it now
            run.record(tier, len(out.prompt_token_ids), len(c.token_ids), confidence=round(confidence, 4),
                       decision="escalated")
            self.metrics.escalations.labels(self.spec.name, tier, "low_confidence").inc()
            i, state = found

    async def _next_tier(self, tiers: Tiers, start: int, run: _Run):
        """(index, state) of the first tier from `start` whose model can be acquired; the others are
        `skipped` with their reason. None when none can (`run.error`: the last one's error)."""
        for j in range(start, len(self.spec.tiers)):
            tier = self.spec.tiers[j]
            try:
                return j, await tiers.acquire(tier)
            except APIError as err:
                run.skipped.append({"model": tier, "reason": err.message})
                run.error = err
                self.metrics.escalations.labels(self.spec.name, tier, "tier_unavailable").inc()
        return None

    async def _respond(self, view, group: RequestGroup, request: Request, run: _Run, tier: str, index: int):
        escalated = index > 0
        done = run.tiers[-1] if run.tiers and run.tiers[-1]["model"] == tier else None

        def annotate(usage: dict) -> dict:
            if done is not None:
                done.update(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"])
            else:
                run.record(tier, usage["prompt_tokens"], usage["completion_tokens"], decision="answered")
            fields = {"served_by": tier, "escalated": escalated,
                      "confidence": None if run.confidence is None else round(run.confidence, 4)}
            if run.signals is not None:
                fields["confidence_signals"] = {k: round(v, 4) for k, v in run.signals.items()}
            if run.skipped:
                fields["skipped"] = run.skipped
            prompt = sum(t["prompt_tokens"] for t in run.tiers)
            completion = sum(t["completion_tokens"] for t in run.tiers)
            fields["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion,
                               "tiers": [{k: t[k] for k in ("model", "prompt_tokens", "completion_tokens")}
                                         for t in run.tiers]}
            self._seen(run, tier, escalated)
            return fields

        view.annotate = annotate
        return await view.respond(group, request)

    def _seen(self, run: _Run, tier: str, escalated: bool) -> None:
        name = self.spec.name
        self.metrics.answered.labels(name, tier).inc()
        for t in run.tiers:
            self.metrics.tokens.labels(name, t["model"], "prompt").inc(t.get("prompt_tokens", 0))
            self.metrics.tokens.labels(name, t["model"], "completion").inc(t.get("completion_tokens", 0))
        if self.log_requests:
            skipped = "".join(f"; skipped {s['model']}: {s['reason']}" for s in run.skipped)
            logger.info("cascade %s: answered by %s (%s; %s)%s", name, tier, "escalated" if escalated else "first tier",
                        run.why, skipped)


def _with_logprobs(client_n: list, pool_hidden: bool):
    """The params' logprobs widened to the signals' top-N (the client's own N kept in `client_n`), and
    the pooled hidden state asked for when a probe reads it."""
    def adjust(params) -> None:
        client_n.append(params.logprobs)
        params.logprobs = max(params.logprobs or 0, CONFIDENCE_TOP_N)
        params.pool_hidden = pool_hidden
    return adjust


async def _first_tokens(group: RequestGroup, k: int) -> tuple[list, object]:
    """The newest output of the group's one request once it has k tokens or ended (none: aborted), and
    the iterator of its outputs after that one."""
    held = []
    rest = aiter(group.streams[0])
    while True:
        try:
            out = await anext(rest)
        except StopAsyncIteration:
            return held, rest
        held = [out]
        if out.finished or out.error is not None or len(out.outputs[0].token_ids) >= k:
            return held, rest


class _HeldGroup(RequestGroup):
    """The request group as a view reads it: the held output first, then the rest of the same stream,
    each with the logprobs cut back to what the client asked for (None: none)."""

    def __init__(self, group: RequestGroup, held: list, rest, client_n: int | None):
        super().__init__(group.async_llm, group.base_id)
        self.streams, self.rest, self.held, self.client_n = group.streams, rest, held, client_n
        self._trimmed: list = []  # the client's logprobs so far (outputs are cumulative)

    async def outputs(self):
        for out in self.held:
            yield 0, self._trim(out)
        if self.held and self.held[-1].finished:
            return
        async for out in self.rest:
            yield 0, self._trim(out)

    def _trim(self, out):
        c = out.outputs[0]
        if c.logprobs is None:
            return out
        if self.client_n is None:
            lps = None
        else:
            for i in range(len(self._trimmed), len(c.logprobs)):
                lp = c.logprobs[i]
                kept = dict(list(lp.items())[: self.client_n])
                kept.setdefault(c.token_ids[i], lp[c.token_ids[i]])
                self._trimmed.append(kept)
            lps = self._trimmed[: len(c.logprobs)]
        return dataclasses.replace(out, outputs=[dataclasses.replace(c, logprobs=lps), *out.outputs[1:]])


def build_cascade_app(cascades: dict[str, Cascade]) -> FastAPI:
    """The two generation routes for cascade names; the front puts the tier acquirer in the scope."""
    app = FastAPI()
    install_error_handlers(app)

    async def run(view_cls, body, request: Request):
        cascade = cascades[body.model]
        return await cascade.answer(view_cls, body, request, request.scope["tokenloom.tiers"])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(CompletionView, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(ChatView, body, request)

    return app
