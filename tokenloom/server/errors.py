"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

`APIError` is raised by handlers (or built and turned into a response with `.response()`); `install_error_handlers` maps everything else onto it: FastAPI's
422 validation errors become 400s (OpenAI's status for a malformed body), engine ValueErrors become
400s whose `param` is the field the message names, a full queue or a dead engine become 503s.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import EngineDeadError, EngineStoppingError, QueueFullError
from ..engine.slo_policy import SLOShedError

logger = logging.getLogger("tokenloom.server")

RETRY_AFTER_S = 1  # a full queue usually drains within a few decode steps
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?::| must| is| needs| every)")


class SafeJSONResponse(JSONResponse):
    """JSON whose strings may hold lone surrogates (echoed input) without failing to encode: they go
    out as JSON escapes (`\\ud800`), which is still valid JSON."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while adding or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SLOShedError):  # --slo-shed: predicted to miss its TTFT by far; the body names slo.ttft_ms
        return APIError(429, str(exc), "rate_limit_error", "slo.ttft_ms", "slo_unattainable",
                        {"Retry-After": str(math.ceil(exc.retry_after_s))})
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "server_error", None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineStoppingError):
        return APIError(503, str(exc), "server_error", None, "shutting_down", {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", None, "engine_dead")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param_of(str(exc)))
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", "server_error")


def param_of(message: str) -> str | None:
    """The field a validation message starts with ("temperature must be >= 0" -> "temperature")."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def _validation_message(exc: RequestValidationError, request: Request) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        err = next(err for err in errors if err.get("type") == "json_invalid")
        where = [x for x in err.get("loc", ()) if isinstance(x, int)]
        at = f" at byte {where[0]}" if where else ""
        reason = (err.get("ctx") or {}).get("error", "")
        return f"body: the request body is not valid JSON{at}" + (f" ({reason})" if reason else ""), "body"
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type.lower() and any(err.get("loc") == ("body",) for err in errors):
        return ("body: send the request body as a JSON object with 'Content-Type: application/json' "
                f"(got {content_type or 'no content type'})"), "body"
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Union members show up in the location as type names; keep the field path only.
        loc = [x for x in loc if not any(c in x for c in "[]")]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)  # the top-level field, as OpenAI reports it
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None)).response()

    async def _mapped(request: Request, exc: Exception):
        return from_exception(exc).response()

    # Registered per class: Starlette re-raises whatever reaches a catch-all `Exception` handler.
    for kind in (ValueError, QueueFullError, EngineStoppingError, EngineDeadError, SLOShedError):
        app.add_exception_handler(kind, _mapped)

    async def _internal(request: Request, exc: Exception):
        # The last resort (Starlette's ServerErrorMiddleware calls it, then re-raises for the log):
        # a JSON 500 rather than a plain-text one.
        return from_exception(exc).response()

    app.add_exception_handler(Exception, _internal)
