"""Pure-ASGI middleware: bearer-key auth and a request-body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched; that is what lets a dropped client abort its request at once.
"""

from __future__ import annotations

import hmac

from .errors import APIError

# Open without a key, like vLLM: probes and scrapers (/health, /metrics) and API discovery.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: by Content-Length when given, else by counting chunks."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send, int(length))
            return
        # Read (at most max_bytes of) the body up front, then replay it to the app.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(scope, receive, send, None)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, length: int | None) -> None:
        got = f"{length} bytes" if length is not None else "more than that"
        message = f"request body too large: the limit is {self.max_bytes} bytes (--max-request-body-bytes), got {got}"
        await APIError(413, message, code="request_too_large").response()(scope, receive, send)
