"""What travels between the ingress and an engine replica for one request (pure Python, no Ray).

The engine's outputs are cumulative (the whole text and token list so far), which is right inside one
process and quadratic over a network: a replica sends its first output whole and after that only what
is new (`OutputDelta`; one may carry several engine steps' tokens: a replica batches its stream,
stream_batching.py); the ingress rebuilds the cumulative output with `apply_delta`, so the HTTP
layer above cannot tell a replica from a local engine. Text and token lists only ever grow (a stop
string's prefix is held back, never sent and retracted), which is what makes the suffixes enough.
A request's own call carries only `Accepted` (or a `Refusal`) and how it ended; its outputs travel with
those of its front's other requests at that replica, on the front's one call there (outbox.py).

A request the replica refuses comes back as a `Refusal` naming the exception class, raised again on
the ingress side as the same class, so the server maps it to the same HTTP status as in one process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.async_llm import EngineDeadError, EngineStoppingError, QueueFullError
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs

ENDED = "ended"  # a request's last item when it ended unfinished (aborted at the replica)
GONE = "gone"  # a mailbox call's answer from a replica it was not for: that one is gone


@dataclass
class Accepted:
    """The first item of every accepted request's call: which replica took it (its outputs come on the
    front's mailbox call to that replica)."""

    replica: str


@dataclass
class ChoiceDelta:
    index: int
    text: str  # appended to the choice's text
    token_ids: list[int]  # appended
    logprobs: list[TokenLogprobs] | None  # appended (None: the request asked for none)
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None


@dataclass
class OutputDelta:
    choices: list[ChoiceDelta]
    finished: bool
    error: str | None
    metrics: RequestMetrics | None
    num_cached_tokens: int


def output_delta(prev: RequestOutput, out: RequestOutput) -> OutputDelta:
    """What `out` adds to `prev` (an earlier output of the same request)."""
    before = {c.index: c for c in prev.outputs}
    choices = []
    for c in out.outputs:
        p = before.get(c.index)
        text_len, ids_len = (len(p.text), len(p.token_ids)) if p is not None else (0, 0)
        lp_len = len(p.logprobs) if p is not None and p.logprobs is not None else 0
        choices.append(ChoiceDelta(c.index, c.text[text_len:], c.token_ids[ids_len:],
                                   None if c.logprobs is None else c.logprobs[lp_len:],
                                   c.finish_reason, c.stop_reason, c.error))
    return OutputDelta(choices, out.finished, out.error, out.metrics, out.num_cached_tokens)


def apply_delta(prev: RequestOutput, delta: OutputDelta) -> RequestOutput:
    """The cumulative output after `delta`; a new object (`prev` is left as it was)."""
    before = {c.index: c for c in prev.outputs}
    outputs = []
    for d in delta.choices:
        p = before.get(d.index) or CompletionOutput(d.index, "", [])
        logprobs = None if d.logprobs is None else [*(p.logprobs or ()), *d.logprobs]
        outputs.append(CompletionOutput(d.index, p.text + d.text, [*p.token_ids, *d.token_ids], d.finish_reason,
                                        d.stop_reason, logprobs, d.error))
    return dataclasses.replace(prev, outputs=outputs, finished=delta.finished, error=delta.error,
                               metrics=delta.metrics, num_cached_tokens=delta.num_cached_tokens)


# The exceptions a replica's `add` raises for a request it does not take; anything else is a bug.
REFUSALS = {cls.__name__: cls for cls in (ValueError, QueueFullError, EngineStoppingError, EngineDeadError)}


@dataclass
class Refusal:
    kind: str  # a key of REFUSALS
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Refusal:
        kind = next(name for name, c in REFUSALS.items() if isinstance(exc, c))
        return cls(kind, str(exc))

    def exception(self) -> Exception:
        return REFUSALS[self.kind](self.message)
