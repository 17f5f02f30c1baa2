"""What one API client may learn about, or do to, the others: who reads /metrics and which of its
counters, and which `priority` values a client may ask for.

/metrics (`MetricsAccess`):
- no --api-key and no --metrics-token: open, everything (one trusted party; the old behaviour);
- --metrics-token T: only `Bearer T` reads it, in full; the API key does not open it;
- --api-key K alone: `Bearer K` reads it, without the prefix-cache counters;
- --metrics-open: anyone reads it (a scraper on a private network), also without those counters
  unless the `Bearer T` of a --metrics-token comes with the scrape.

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

    def view(self, authorization: bytes) -> str | None:
        """'full', 'public' (no prefix-cache counters) or None (refused) for a scrape with this
        Authorization header."""
        if self.api_key is None and self.metrics_token is None:
            return "full"
        if _bearer_is(authorization, self.metrics_token):
            return "full"
        if self.open or (self.metrics_token is None and _bearer_is(authorization, self.api_key)):
            return "public"
        return None

    def refusal(self) -> APIError:
        how = "Bearer <metrics token>" if self.metrics_token is not None else "Bearer <API key>"
        return APIError(401, f"/metrics needs 'Authorization: {how}' (or the server's --metrics-open)",
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
