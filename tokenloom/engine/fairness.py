"""`--fairness vtc`: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024) — a fair share of the engine per tenant, whatever each sends.

Each tenant (a request's `SamplingParams.tenant`: the server sets the body's `user` field; no tenant is
the tenant "") has a counter of the service it received, in weighted tokens: every prompt token the
scheduler plans counts W_INPUT = 1, every decoded token W_OUTPUT = 2 (the paper's weights: a decode
token costs a step's weight reads shared by fewer tokens); tokens served from the prefix cache cost
nothing, a prompt recomputed after a preemption counts again. There is one API key per server, so the
tenant comes from `user` alone (a gateway in front sets it per key). Waiting requests are admitted lowest counter
first (the scheduling policy orders requests of equal counters), so a tenant that sends more does not get
more: its counter rises with what it is served, and the others' requests go ahead of it.

The lift rule keeps a tenant from banking its idle time: when a tenant with nothing waiting or running
sends a request, its counter is raised to the smallest counter among the tenants that are backlogged
(or, when nobody is, to the counter of the tenant served last: the paper's rule), so it competes from where
the others are, not from where it left off. The paper proves the service of two backlogged tenants then
differs by at most 2x the largest request's weighted tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..step import Sequence

W_INPUT = 1.0
W_OUTPUT = 2.0
# Past this many tenants the idle ones at or below the backlog's floor are forgotten: a client that sends
# a new `user` every request must not grow the table without bound, and a forgotten tenant that comes
# back is lifted to the floor anyway.
MAX_REMEMBERED_TENANTS = 1024


def tenant_of(seq: Sequence) -> str:
    return seq.params.tenant or ""


class VirtualTokenCounter:
    def __init__(self, w_input: float = W_INPUT, w_output: float = W_OUTPUT):
        self.w_input, self.w_output = w_input, w_output
        self.counters: dict[str, float] = {}
        self._last_served = 0.0  # the counter of the tenant last charged

    def counter(self, seq: Sequence) -> float:
        return self.counters.get(tenant_of(seq), 0.0)

    def arrive(self, seq: Sequence, queued: Iterable[Sequence]) -> None:
        """A new sequence; `queued`: every sequence waiting or running before it (the lift rule)."""
        tenant = tenant_of(seq)
        backlogged = {tenant_of(s) for s in queued}
        if tenant in backlogged:
            return
        floor = min(self.counters.get(t, 0.0) for t in backlogged) if backlogged else self._last_served
        if len(self.counters) >= MAX_REMEMBERED_TENANTS:
            self.counters = {t: c for t, c in self.counters.items() if t in backlogged or c > floor}
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        tenant = tenant_of(seq)
        self.counters[tenant] = self._last_served = (self.counters.get(tenant, 0.0) + self.w_input * prompt_tokens
                                                     + self.w_output * output_tokens)
