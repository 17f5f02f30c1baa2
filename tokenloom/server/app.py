"""The FastAPI application: `build_app(async_llm, served_model_name, api_key, ...)`.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /version, /tokenize,
/detokenize, /metrics, /dashboard (and its /stream, /stats: dashboard.py). The app's lifespan starts the AsyncLLM's engine thread and, on shutdown,
lets in-flight requests finish (up to `shutdown_timeout`) before stopping it. Auth and the body
limit are pure-ASGI middleware (see middleware.py); every error is OpenAI-shaped (errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__
from ..engine.async_llm import AsyncLLM
from ..model.lora import LoRARequest
from ..slo import SLOPolicy
from .chat import create_chat_completion, render_prompt_ids
from .completions import create_completion
from .dashboard import DashboardOptions, add_dashboard_routes
from .errors import APIError, install_error_handlers
from .lora_routes import add_lora_routes
from .middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from .state import ServerState, now_s
from .tenancy import ClientPriorityRange, MetricsAccess, public_metrics

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
_GENERATION_RESPONSES = {
    200: {
        "description": "A JSON completion, or with `stream: true` a server-sent event stream of chunks "
        "(`data: {...}` lines ending with `data: [DONE]`).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string", "description": "data: {chunk}\\n\\n ... data: [DONE]"}},
        },
    },
    **_ERRORS,
}


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    *,
    metrics=None,
    model_path: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_timeout: float = 30.0,
    metrics_token: str | None = None,
    metrics_open: bool = False,
    client_priority: ClientPriorityRange | None = None,
    trust_chat_messages: bool = False,
    reasoning_parser: str | None = None,
    lora_modules: list[LoRARequest] | None = None,
    allow_runtime_lora_updating: bool = False,
    dashboard: DashboardOptions | None = None,
    slo_policy: SLOPolicy | None = None,
) -> FastAPI:
    """`metrics_token`/`metrics_open`: who reads /metrics (tenancy.MetricsAccess); `client_priority`:
    the `priority` values a client may send; `trust_chat_messages`: chat message content may
    spell control tokens that take effect (off: content is text, see chat_text.py); `reasoning_parser`:
    thinking blocks as `reasoning_content` (reasoning.py); `dashboard`: the live view's options
    (dashboard.py; on by default); `slo_policy`: the SLO defaults and classes (slo.py)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    state = ServerState(async_llm, names or ["tokenloom"], model_path, metrics,
                        client_priority=client_priority or ClientPriorityRange(),
                        trust_chat_messages=trust_chat_messages, reasoning_parser=reasoning_parser)
    state.loras = {r.lora_name: r for r in lora_modules or ()}
    if clash := [name for name in state.loras if name in state.served_model_names]:
        raise ValueError(f"--lora-modules: {clash[0]!r} is the base model's served name; an adapter needs its own "
                         "(requests for the base would run under it)")
    if state.adapters is not None:
        state.adapters.auto_register = False  # on a server only the operator's routes register a name
    state.slo_policy = slo_policy or SLOPolicy()
    metrics_access = MetricsAccess(api_key, metrics_token, metrics_open)

    deadline: list[float] = []  # set once shutdown begins

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        async_llm.start()

        def begin_shutdown() -> None:
            """Called from the SIGTERM/SIGINT handler (on the loop's thread): refuse new requests at
            once and give the engine `shutdown_timeout` seconds; what is still running then is
            aborted and each view answers it with an error in its protocol's shape."""
            if deadline:
                return
            deadline.append(time.monotonic() + shutdown_timeout)
            state.shutting_down = True
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(async_llm.shutdown(shutdown_timeout)))

        app.state.begin_shutdown = begin_shutdown
        yield
        state.shutting_down = True
        remaining = shutdown_timeout if not deadline else max(deadline[0] - time.monotonic(), 0.0)
        await async_llm.shutdown(remaining)
        state._executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server with continuous batching")
    app.state.tokenloom = state
    app.state.access_line = metrics_access.describe(bool(dashboard and dashboard.enabled and dashboard.show_text))
    install_error_handlers(app)

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, state)

    @app.get("/v1/models")
    async def models(request: Request):
        # Filesystem paths only for the operator's --metrics-token: a client learns names, not the layout.
        paths = metrics_access.operator_token(request.headers.get("authorization", "").encode("latin-1", "replace"))
        data = [
            {"id": name, "object": "model", "created": now_s(), "owned_by": "tokenloom",
             "root": (model_path or name) if paths else name, "max_model_len": async_llm.config.max_model_len}
            for name in state.served_model_names
        ]
        for name, lora in state.loras.items():
            entry = {"id": name, "object": "model", "created": now_s(), "owned_by": "tokenloom",
                     "root": name, "parent": state.model_name, "max_model_len": async_llm.config.max_model_len}
            if paths:
                entry.update(root=lora.lora_path, lora_path=lora.lora_path)
            data.append(entry)
        return {"object": "list", "data": data}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        problem = async_llm.health_problem()  # 200 only while the engine thread is alive and stepping
        if problem is None:
            return Response(status_code=200)
        return APIError(503, problem, "server_error", code="engine_dead").response()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            _, tokens = await render_prompt_ids(state, ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs),
                add_special_tokens=body.add_special_tokens)
        else:
            tokens = await state.encode(body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": async_llm.config.max_model_len, "tokens": tokens}

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        if len(body.tokens) > state.max_model_len:
            raise _detokenize_too_long(state.max_model_len)
        vocab = state.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: every id must be in [0, {vocab})", param="tokens")
        return {"prompt": await state.decode(body.tokens)}

    @app.get("/metrics", responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def prometheus_metrics(request: Request):
        view = metrics_access.view(request.headers.get("authorization", "").encode("latin-1"))
        if view is None:
            return metrics_access.refusal().response()
        if metrics is None:
            return APIError(404, "metrics are disabled").response()
        from ..engine.metrics import CONTENT_TYPE

        text = metrics.render()
        return Response(text if view == "full" else public_metrics(text), media_type=CONTENT_TYPE)

    add_lora_routes(app, state, allow_runtime_lora_updating)
    dashboard = dashboard or DashboardOptions()
    if dashboard.enabled:
        add_dashboard_routes(app, state, metrics_access, dashboard)  # /metrics' rule, checked by its routes

    # Starlette runs the middleware added last first: auth (headers only) before anything reads a
    # body, then the size limits, then the app.
    max_ids = async_llm.config.max_model_len
    detokenize_limit = (max_ids * DETOKENIZE_BYTES_PER_ID + DETOKENIZE_SLACK_BYTES, _detokenize_too_long(max_ids))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes,
                       route_limits={"/detokenize": detokenize_limit})
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, operator_token=metrics_token)
    return app


# /detokenize takes at most a context's worth of ids, and its body is bounded to match before it is
# parsed: a million ids parse into ~40 MB of Python ints each, and 60 such calls left the process
# 1.9 GB larger for good (freed ints stay in the allocator's arenas).
DETOKENIZE_BYTES_PER_ID = 16  # "49151, " is 7; room for whitespace
DETOKENIZE_SLACK_BYTES = 64 * 1024


def _detokenize_too_long(max_ids: int) -> APIError:
    return APIError(400, f"tokens: /detokenize takes at most {max_ids} token ids (max_model_len; a body over "
                    f"{max_ids * DETOKENIZE_BYTES_PER_ID + DETOKENIZE_SLACK_BYTES} bytes is refused unread)",
                    param="tokens")
