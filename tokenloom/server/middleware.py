"""Pure-ASGI middleware: bearer-key auth and a request-body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched; that is what lets a dropped client abort its request at once.
Auth runs outermost and looks at the headers only: a request without the key is answered before
one byte of its body is read (100 unauthenticated 15 MB bodies used to be buffered first: +750 MB).
Then the size limit, which may be tighter per route (/detokenize: its ids cannot exceed a context),
and a bound on how deeply the body's JSON nests (MAX_JSON_DEPTH), checked on the raw bytes before
anything parses them: Python's JSON parser and every walk over the parsed value recurse, and a
body nested 100,000 deep was a RecursionError 500 (grammar fields have their own, lower bounds).
"""

from __future__ import annotations

import hmac
import re

import numpy as np

from .errors import APIError

MAX_JSON_DEPTH = 256  # arrays/objects inside one another; a JSON schema's own bound is lower
# A string runs to its closing quote or, unterminated, to the end (possessive, and every start
# matches: one pass over the body whatever it holds, never a retry from each quote inside).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = np.zeros(256, dtype=np.int32)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_CHUNK = 1 << 20


def _bracket_depth(brackets: bytes, limit: int) -> int:
    """The deepest running count of `brackets` (only []{} bytes), or the first count past `limit`."""
    depth = best = 0
    for start in range(0, len(brackets), _CHUNK):
        steps = _BRACKET_STEP[np.frombuffer(brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - start),
                                            offset=start)]
        running = np.cumsum(steps) + depth
        best = max(best, int(running.max()))
        if best > limit:
            break
        depth = int(running[-1])
    return best


def json_nesting_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply arrays and objects nest in `body` (brackets inside strings do not count), exactly
    up to `limit` (past it, some depth above it). A body with at most `limit` opening brackets cannot
    nest deeper (nearly every request: one count in C); any other has its strings taken out (one
    regex pass: ~1 s for 16 MB of short strings, milliseconds for ordinary bodies) and its brackets
    counted in numpy."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return min(limit, body.count(b"[") + body.count(b"{"))
    return _bracket_depth(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), limit)


# Open without a key, like vLLM: probes (/health, /version) and the API description. /metrics has
# its own rule (tenancy.MetricsAccess), checked by its route: it has no body to protect.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """`operator_token` (--metrics-token) is also let through to GET /v1/models, where it sees paths."""

    def __init__(self, app, api_key: str, operator_token: str | None = None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.operator = f"Bearer {operator_token}".encode() if operator_token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            operator = (self.operator is not None and scope["path"] == "/v1/models" and scope["method"] == "GET"
                        and hmac.compare_digest(given, self.operator))
            if not operator and not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: by Content-Length when given, else by counting chunks.
    `route_limits` maps a path to a tighter limit and the APIError that refuses a body over it."""

    def __init__(self, app, max_bytes: int, route_limits: dict[str, tuple[int, APIError]] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.route_limits = route_limits or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit, refusal = self.route_limits.get(scope["path"], (self.max_bytes, None))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._reject(scope, receive, send, int(length), limit, refusal)
            return
        # Read (at most max_bytes of) the body up front, then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > limit:
                await self._reject(scope, receive, send, None, limit, refusal)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break

        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        if (depth := json_nesting_depth(body)) > MAX_JSON_DEPTH:
            await APIError(400, f"body: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted",
                           param="body").response()(scope, receive, send)
            return

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, length: int | None, limit: int, refusal: APIError | None) -> None:
        if refusal is None:
            got = f"{length} bytes" if length is not None else "more than that"
            message = f"request body too large: the limit is {limit} bytes (--max-request-body-bytes), got {got}"
            refusal = APIError(413, message, code="request_too_large")
        await refusal.response()(scope, receive, send)
