"""What one API client may learn about, or do to, the others: who reads /metrics and the dashboard and
which of their counters, and which `priority` values a client may ask for.

/metrics and the dashboard (`MetricsAccess`, one rule for both):
- no --api-key and no --metrics-token: open, everything (one trusted party; the old behaviour);
- --metrics-token T: only `Bearer T` reads it, in full; the API key does not open it;
- --api-key K alone: `Bearer K` reads it, without the prefix-cache counters;
- --metrics-open: anyone reads it (a scraper on a private network), also without those counters
  unless the `Bearer T` of a --metrics-token comes with the scrape.
The dashboard (page, stream, stats) follows the same rule, --metrics-open aside: with --metrics-token
only `Bearer T` opens it, even without --api-key. What the prefix-cache counters hide there too: the
hit counters, the cached/shared marks of the block map and each request's block ids (two requests on
one block are a prefix hit). Prompt and output text (--dashboard-show-text) go only to `Bearer T`.

Why the prefix-cache counters are kept from API clients: every client of one key can send a prompt
with a guessed secret and watch `prefix_cache_hits` move, learning whether someone else's prompt held
it (a 4-digit code was recovered this way, one guess at a time). The same holds for the time to first
token of one's own request (a hit skips the prefill); no counter can hide that, so tenants that must
not learn each other's prompts need distinct `cache_salt` values (set by the gateway that knows the
tenant, as with vLLM): requests under different salts never share a block.

`priority` (`ClientPriorityRange`): lower runs sooner, so a client that could send -2**31 would jump
every queue and, with aging at one level per --priority-aging-s, keep a priority-0 request waiting for
ever. A client may ask only for values in [--min-client-priority, --max-client-priority] (default
[0, 1000]: it may lower its own priority, never raise it above the default); an operator who wants
clients to jump the queue lowers the minimum, which also bounds how long they can make a priority-0
request wait: -min x --priority-aging-s seconds of its aging.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .errors import APIError

PREFIX_CACHE_FAMILY = b"tokenloom:prefix_cache_"
DEFAULT_MIN_CLIENT_PRIORITY = 0
DEFAULT_MAX_CLIENT_PRIORITY = 1000


def _bearer_is(authorization: bytes, secret: str | None) -> bool:
    return secret is not None and hmac.compare_digest(authorization, f"Bearer {secret}".encode())


@dataclass(frozen=True)
class MetricsAccess:
    api_key: str | None = None
    metrics_token: str | None = None
    open: bool = False

    def view(self, authorization: bytes, scrape: bool = True) -> str | None:
        """'full', 'public' (no prefix-cache counters) or None (refused) for a request with this
        Authorization header. The one rule for everything that shows engine state: /metrics
        (`scrape`) and the dashboard's page, stream and stats (not `scrape`: --metrics-open opens
        scrapes only)."""
        if self.api_key is None and self.metrics_token is None:
            return "full"
        if _bearer_is(authorization, self.metrics_token):
            return "full"
        if (scrape and self.open) or (self.metrics_token is None and _bearer_is(authorization, self.api_key)):
            return "public"
        return None

    def operator_token(self, authorization: bytes) -> bool:
        """The operator's own token (--metrics-token) came with the request: what only the operator
        sees (prompt and output text on the dashboard, filesystem paths) needs it, even on a server
        without --api-key."""
        return _bearer_is(authorization, self.metrics_token)

    def describe(self, show_text: bool = False) -> str:
        """Who sees what, for the start-up line."""
        if self.api_key is None and self.metrics_token is None:
            return "engine state (/metrics, dashboard): anyone, in full (no --api-key, no --metrics-token)"
        full = "the metrics token" if self.metrics_token is not None else "nobody"
        public = []
        if self.metrics_token is None and self.api_key is not None:
            public.append("the API key")
        if self.open:
            public.append("anyone (/metrics only, --metrics-open)")
        line = (f"engine state (/metrics, dashboard): in full for {full}; without the prefix-cache counters and "
                f"block map for {' and '.join(public) or 'nobody else'}")
        if show_text:
            line += "; prompt and output text: the metrics token only"
        return line

    def refusal(self, what: str = "/metrics") -> APIError:
        how = "Bearer <metrics token>" if self.metrics_token is not None else "Bearer <API key>"
        tail = " (or the server's --metrics-open)" if what == "/metrics" else ""
        return APIError(401, f"{what} needs 'Authorization: {how}'{tail}",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})



def public_metrics(exposition: bytes) -> bytes:
    """The Prometheus text without the prefix-cache families (their HELP, TYPE and sample lines)."""
    keep = []
    for line in exposition.splitlines(keepends=True):
        name = line.split(b" ", 3)[2] if line.startswith(b"# ") else line
        if not name.startswith(PREFIX_CACHE_FAMILY):
            keep.append(line)
    return b"".join(keep)


@dataclass(frozen=True)
class ClientPriorityRange:
    lowest: int = DEFAULT_MIN_CLIENT_PRIORITY  # the most urgent value a client may send
    highest: int = DEFAULT_MAX_CLIENT_PRIORITY

    def __post_init__(self) -> None:
        if self.lowest > self.highest:
            raise ValueError(f"min_client_priority: {self.lowest} is above max_client_priority {self.highest}")

    def check(self, priority: int) -> None:
        if self.lowest <= priority <= self.highest:
            return
        why = ("a client may not raise its priority above the default (lower values run sooner); "
               "the operator's --min-client-priority allows it" if priority < self.lowest else "")
        raise APIError(400, f"priority: must be an integer in [{self.lowest}, {self.highest}] on this server, "
                       f"got {priority}" + (f" ({why})" if why else ""), param="priority")
