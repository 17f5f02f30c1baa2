"""`tokenloom serve A B NAME=SOURCE ...`: several models behind one port (issue 54).

Each model is the app `tokenloom serve MODEL` builds (server/app.py, its own AsyncLLM and engine
thread), started and stopped by the ModelSet (model_set.py) as it loads and evicts. The front here is a
pure-ASGI dispatcher: the generation and token routes read the body once, pick the model by its `model`
field (absent: the first model) and hand the request, body replayed, to that model's app, counted in
flight until its response (a stream included) is done. The front's own routes: `GET /v1/models` and
`/models` (every configured model with its status and bytes), `POST /models/load` / `/models/unload`,
`/health`, `/version`, `/metrics` (every resident model's families merged, each sample labelled by
`model_name`, plus the set's gauges). Any other path (the dashboard, LoRA routes) goes to the model
named by `?model=`, else the first. The engines share one ForwardTurn: one forward at a time.
A generation request naming a cascade (`--cascade NAME=SMALL,LARGE`) goes to cascade.py, which
acquires each tier's model here as it runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import json
import logging
import math
import os
import re
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__
from ..engine.forward_turn import ForwardTurn
from ..process_memory import release_free_heap, rss_bytes
from .cascade import Cascade, CascadeMetrics, build_cascade_app
from .cascade_config import build_rule, parse_cascades
from .errors import APIError, install_error_handlers
from .model_set import (
    Handle,
    ModelSet,
    ModelSpec,
    ModelTooLarge,
    check_names,
    estimate_bytes,
    parse_model_specs,
    parse_models_preset,
)
from .multi_flags import preset_flags

logger = logging.getLogger("tokenloom.server")

ROUTED_POSTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
CASCADE_POSTS = ("/v1/completions", "/v1/chat/completions")
FRONT_PATHS = ("/v1/models", "/models", "/models/load", "/models/unload", "/health", "/version", "/metrics")
DEFAULT_BUDGET_SHARE = 0.8  # of the memory this process may use (the cgroup limit, else MemTotal)


def default_budget() -> int:
    limit = None
    with contextlib.suppress(OSError, ValueError):
        text = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115
        limit = None if text == "max" else int(text)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(DEFAULT_BUDGET_SHARE * min(limit or total, total))


def real_loader(args: argparse.Namespace, turn: ForwardTurn, dashboard):
    """ModelSpec -> Handle: the model loaded as `serve MODEL` loads it (in a worker thread)."""
    from ..config import engine_config_from_args
    from ..model import catalog
    from .app import build_app
    from .loading import app_options, load_served_engine

    def load(spec: ModelSpec) -> Handle:
        ns = spec_args(args, spec)
        config = engine_config_from_args(ns)
        catalog.pull_missing(config.model)
        catalog.pull_missing(config.draft_model, "speculative_config.model")
        served = load_served_engine(ns, config, spec.lora_modules)
        served.async_llm.turn = turn
        app = build_app(served.async_llm, served.names, metrics=served.metrics, model_path=served.path,
                        dashboard=dashboard, lora_modules=list(spec.lora_modules),
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating, **app_options(ns))
        stack = contextlib.AsyncExitStack()

        async def start() -> None:
            await stack.enter_async_context(app.router.lifespan_context(app))

        async def stop(timeout: float) -> None:
            await stack.aclose()
            _forget_endpoints()

        engine = served.async_llm.engine
        return Handle(app, resident_bytes(engine), start, stop, served.async_llm.health_problem,
                      {"root": served.path, "max_model_len": config.max_model_len}, served.metrics,
                      lambda: {name: r.lora_path for name, r in app.state.tokenloom.loras.items()},
                      unfaulted=kv_pool_bytes(engine))

    return load


def spec_args(args: argparse.Namespace, spec: ModelSpec) -> argparse.Namespace:
    """The command line's flags with `spec`'s own (its preset table's) over them, its source and names."""
    return argparse.Namespace(**{**vars(args), **dict(spec.flags), "model": spec.source,
                                 "served_model_name": list(spec.names)})


def _local(source: str | None) -> list[str]:
    """A draft model's file, if it is on this machine yet (a catalog draft is pulled at its model's load)."""
    from ..model.load import model_path

    try:
        return [model_path(source)] if source else []
    except (OSError, ValueError):
        return []


def _collect_frozen() -> None:
    """The unloaded engine's cycles collected now: every engine build freezes what exists (gc.freeze in
    engine/builder.py, so collections skip the weights), which put the unloaded one out of the
    collector's reach for good. Unfreeze, collect, freeze the survivors again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_heap()  # the unloaded model's pages back to the OS: the next load's bytes are its own


def _forget_endpoints() -> None:
    """FastAPI keeps every endpoint function it has classified in module-level LRU caches (thousands of
    entries): each of an unloaded model's routes, a closure over its AsyncLLM, kept the whole engine and
    its weights alive (RSS grew by a model per unload / load). Cleared here; they refill as requests come."""
    from fastapi.dependencies import models as fastapi_models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = getattr(fastapi_models, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def resident_bytes(engine) -> int:
    """What the model holds once loaded: its weights (parameters and buffers) and KV pool (device and
    host-swap tensors), a draft model's weights and KV pool, and the adapters loaded by then (its
    `lora_modules`; one loaded at run time is not counted: it goes with the model when that unloads)."""
    from ..model.load import weight_bytes

    total = (weight_bytes(engine.model) if engine.model is not None else 0) + kv_pool_bytes(engine)
    draft = getattr(engine.speculation, "draft", None)
    if getattr(draft, "model", None) is not None:
        total += weight_bytes(draft.model)
    if engine.adapters is not None:
        total += sum(w.nbytes for w in engine.adapters.loaded.values())
    return total


def kv_pool_bytes(engine) -> int:
    """The KV pools' bytes (device and host-swap, a draft model's too): made on untouched pages
    (process_memory.zeroed), they become resident only as the cache fills."""
    def pool(runner) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(runner, "kv_cache", None),
                                                         getattr(runner, "host_cache", None)) if t is not None)

    draft = getattr(engine.speculation, "draft", None)
    return pool(engine.runner) + (pool(draft.runner) if getattr(draft, "model", None) is not None else 0)


class MultiModelApp:
    """The pure-ASGI front: dispatches model routes to the models' apps, the rest to `front`."""

    def __init__(self, models: ModelSet, front: FastAPI, api_key: str | None,
                 cascades: dict[str, Cascade] | None = None):
        self.models = models
        self.cascades = cascades or {}
        self.cascade_app = build_cascade_app(self.cascades)
        self.front = front
        self.state = front.state  # the CLI's signal handler finds begin_shutdown here
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" or scope["path"] in FRONT_PATHS:
            if self._refused(scope):
                await _unauthorized()(scope, receive, send)
                return
            await self.front(scope, receive, send)
            return
        name, replay, body = None, receive, {}
        generation = scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTED_POSTS
        if generation:
            body, replay = await _json_body(receive)
            name = body.get("model") if isinstance(body.get("model"), str) else None
            if name in self.cascades:
                await self._cascade(scope, replay, send)
                return
        else:
            name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        try:
            if self.front.state.tokenloom.shutting_down:
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/load_lora_adapter":
                body, replay = await _json_body(receive)
                self._check_new_adapter(body.get("lora_name"))
            # Only a generation request (behind the API key) loads a model: a dashboard or an unknown
            # path, which the key does not guard, must not make the server load and evict.
            keep_alive = parse_keep_alive(body.get("keep_alive"))
            slot = await self.models.acquire(name, autoload=generation)
        except APIError as err:
            if scope["type"] == "http":
                await err.response()(scope, replay, send)
            return
        if scope["path"].startswith("/dashboard"):
            # A viewer is no request in flight: it must not keep its model from eviction or sleep (an
            # unloaded model's stream ends, saying the model is shutting down).
            await self.models.release(slot)
            await slot.handle.app(scope, replay, send)
            return
        try:
            await slot.handle.app(scope, replay, send)
        finally:
            await self.models.release(slot, keep_alive)

    def _check_new_adapter(self, name) -> None:
        """An adapter loaded at run time must not take a name that routes elsewhere: a model's, an alias,
        another model's adapter or a cascade's (its model's own app refuses its own names)."""
        if not isinstance(name, str):
            return  # the model's app answers a bad body
        try:
            self.models.slot(name)  # the set's own lookup: names, aliases, adapters (run-time ones too)
            taken = True
        except APIError:
            taken = name in self.cascades
        if taken:
            raise APIError(400, f"lora_name: {name!r} is already served by this server (a model, an adapter or a "
                           "cascade); give the adapter a name of its own", param="lora_name")

    async def _cascade(self, scope, receive, send) -> None:
        """A request for a cascade: cascade.py runs it, acquiring each tier's model through `TierAccess`
        (an escalated tier is released as soon as it is aborted, so the next may evict it)."""
        access = TierAccess(self.models)
        try:
            if self.front.state.tokenloom.shutting_down:
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if scope["path"] not in CASCADE_POSTS:
                raise APIError(400, f"model: a cascade has no one tokenizer; use a tier's model for {scope['path']}",
                               param="model")
            await self.cascade_app({**scope, "tokenloom.tiers": access}, receive, send)
        except APIError as err:
            await err.response()(scope, receive, send)
        finally:
            await access.release_all()

    def _refused(self, scope) -> bool:
        return (self.expected is not None and scope["type"] == "http" and scope["path"].startswith("/models")
                and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected))


class TierAccess:
    """The tiers one cascade request holds: each acquired (loaded, in flight) when it runs."""

    def __init__(self, models: ModelSet):
        self.models = models
        self.held: dict[str, object] = {}

    async def acquire(self, name: str):
        slot = await self.models.acquire(name)
        self.held[name] = slot
        return slot.handle.app.state.tokenloom

    async def release(self, name: str) -> None:
        if (slot := self.held.pop(name, None)) is not None:
            await self.models.release(slot)

    async def release_all(self) -> None:
        for name in list(self.held):
            await self.release(name)


def _unauthorized() -> Response:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()


async def _json_body(receive):
    """The request's body parsed as a JSON object ({} when it is not one: the model's own app answers a
    bad body) and a receive that replays it. The body is already bounded by the size-limit middleware."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    try:
        parsed = json.loads(b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request"))
    except ValueError:
        parsed = None

    async def replay():
        return chunks.pop(0) if chunks else await receive()

    return (parsed if isinstance(parsed, dict) else {}), replay


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value) -> float | None:
    """A request's `keep_alive`, as Ollama takes it: seconds (a number) or a duration ("30s", "5m",
    "1h", "-1"); 0 unloads the model once idle, a negative one keeps it. None when absent; a 400 naming
    the field otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise APIError(400, f"keep_alive: seconds or a duration such as \"5m\", got {type(value).__name__}",
                       param="keep_alive")
    match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    try:
        seconds = float(value) if not isinstance(value, str) else (
            float(match.group(1)) * _UNIT_S[match.group(2)] if match else math.nan)
    except OverflowError:  # an integer of hundreds of digits
        seconds = math.inf
    if not math.isfinite(seconds) or abs(seconds) > 10 ** 9:
        raise APIError(400, f"keep_alive: seconds or a duration such as \"5m\", got {value!r}"[:200], param="keep_alive")
    return seconds


class _FrontState:
    def __init__(self, names: list[str]):
        self.model_name = ", ".join(names)
        self.shutting_down = False


class _MergedRegistry:
    """Several Prometheus registries as one (families of one name merged; each sample keeps its labels)."""

    def __init__(self, registries):
        self.registries = registries

    def collect(self):
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name not in families:
                    families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name].samples.extend(family.samples)
        return list(families.values())


def build_front(models: ModelSet, *, api_key, metrics_token, metrics_open, shutdown_timeout: float,
                on_start=(), cascades: dict[str, Cascade] | None = None, cascade_metrics=None) -> FastAPI:
    """The front's own routes and lifespan (`on_start`: the models to load before serving; `cascades`:
    listed in /v1/models, their counters in /metrics)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from ..engine.metrics import CONTENT_TYPE
    from .state import now_s
    from .tenancy import MetricsAccess, public_metrics

    registry = CollectorRegistry()
    gauges = {
        "resident": Gauge("tokenloom:model_resident_bytes", "Bytes a model holds (weights, KV pool, draft, adapters).",
                          ["model_name"], registry=registry),
        "loaded": Gauge("tokenloom:model_loaded", "1 while a model is resident.", ["model_name"], registry=registry),
        "loads": Gauge("tokenloom:model_loads", "Loads of a model since start.", ["model_name"], registry=registry),
        "waits": Gauge("tokenloom:model_load_waits", "Requests that waited for the model's load since start.",
                       ["model_name"], registry=registry),
        "wait_s": Gauge("tokenloom:model_load_wait_seconds", "Seconds requests waited for the model's load, summed.",
                        ["model_name"], registry=registry),
        "load_s": Gauge("tokenloom:model_last_load_seconds", "Seconds the model's last load took.",
                        ["model_name"], registry=registry),
    }
    evictions = Gauge("tokenloom:model_evictions", "Models evicted to make room since start.", registry=registry)
    sleeps = Gauge("tokenloom:model_sleeps", "Models unloaded for idleness (keep-alive) since start.", registry=registry)
    total = Gauge("tokenloom:models_resident_bytes", "Bytes all resident models hold.", registry=registry)
    budget = Gauge("tokenloom:models_memory_budget_bytes", "The memory budget (--memory-budget).", registry=registry)
    access = MetricsAccess(api_key, metrics_token, metrics_open)
    state = _FrontState(list(models.slots))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        def begin_shutdown() -> None:
            state.shutting_down = True
            for slot in models.slots.values():
                begin = getattr(getattr(slot.handle, "app", None), "state", None)
                if begin is not None and hasattr(begin, "begin_shutdown"):
                    begin.begin_shutdown()  # each model refuses new work and drains within --shutdown-timeout

        app.state.begin_shutdown = begin_shutdown
        for name in on_start:
            try:
                await models.load(name, evict=False)  # those that fit beside the ones before
            except APIError as err:
                logger.error("model %s not loaded at start: %s", name, err)
        logger.info("models: %s", "; ".join(f"{s.name} {s.status} ({s.resident_bytes} bytes)"
                                            for s in models.slots.values()))
        sleeper = asyncio.create_task(models.run_sleeper())
        yield
        sleeper.cancel()
        state.shutting_down = True
        await models.close(shutdown_timeout)

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan)
    app.state.tokenloom = state
    install_error_handlers(app)

    @app.get("/v1/models")
    @app.get("/models")
    async def list_models(request: Request):
        # Filesystem paths only for the operator's --metrics-token, as `serve MODEL` answers.
        paths = access.operator_token(request.headers.get("authorization", "").encode("latin-1", "replace"))
        listed = [{"id": c.spec.name, "object": "model", "created": now_s(), "owned_by": "tokenloom",
                   "cascade": {"tiers": list(c.spec.tiers), "k": c.rule.k, "signal": c.rule.signal,
                               "threshold": c.rule.current_threshold(),  # a running one's value now
                               **({"target_escalation": c.rule.target_escalation}
                                  if c.rule.target_escalation is not None else {})}}
                  for c in (cascades or {}).values()]
        return {"object": "list", "data": models.describe(paths) + listed}

    async def _name(request: Request) -> str:
        try:
            body = await request.json()
        except ValueError:
            body = None
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "model: give the model's name, as {\"model\": NAME}", param="model")
        return name

    @app.post("/models/load")
    async def load(request: Request):
        slot = await models.load(await _name(request))
        return {"success": True, "model": slot.name, "status": slot.status_json()}

    @app.post("/models/unload")
    async def unload(request: Request):
        slot = await models.unload(await _name(request))
        return {"success": True, "model": slot.name, "status": slot.status_json()}

    @app.get("/health")
    async def health():
        for slot in models.slots.values():
            if slot.handle is not None and (problem := slot.handle.health_problem()) is not None:
                return APIError(503, f"model `{slot.name}`: {problem}", "server_error", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        view = access.view(request.headers.get("authorization", "").encode("latin-1"))
        if view is None:
            return access.refusal().response()
        for slot in models.slots.values():
            gauges["resident"].labels(slot.name).set(slot.resident_bytes)
            gauges["loaded"].labels(slot.name).set(1 if slot.status == "loaded" else 0)
            gauges["loads"].labels(slot.name).set(slot.loads)
            gauges["load_s"].labels(slot.name).set(slot.load_seconds)
            gauges["waits"].labels(slot.name).set(slot.load_waits)
            gauges["wait_s"].labels(slot.name).set(slot.load_wait_seconds)
        evictions.set(models.evictions)
        sleeps.set(models.sleeps)
        total.set(models.resident_bytes)
        budget.set(models.budget or 0)
        registries = [registry, *([cascade_metrics.registry] if cascade_metrics else []),
                      *(s.handle.metrics.registry for s in models.slots.values()
                        if s.handle is not None and s.handle.metrics is not None)]
        text = generate_latest(_MergedRegistry(registries))
        return Response(text if view == "full" else public_metrics(text), media_type=CONTENT_TYPE)

    return app


def overview(models: ModelSet, cascades: dict[str, Cascade], cascade_metrics: CascadeMetrics | None) -> dict:
    """What every model's dashboard shows of the whole server: each configured model (its status, bytes,
    requests in flight and, when resident, its batch as its engine last published it) and each cascade's
    counters. Read on the event loop; only `EngineMetrics.latest` comes from an engine thread (one
    reference, replaced whole)."""
    rows = []
    for s in models.slots.values():
        latest = getattr(s.handle.metrics, "latest", None) if s.handle is not None else None
        rows.append({"name": s.name, "status": s.status, "resident_bytes": s.resident_bytes, "pinned": s.pinned,
                     "in_flight": s.inflight, "loads": s.loads,
                     **({"running": latest.num_running, "waiting": latest.num_waiting,
                         "kv_usage": round(latest.kv_usage, 4)} if latest is not None else {})})
    counts = cascade_metrics.summary() if cascade_metrics is not None else {}
    return {"models": rows, "resident_bytes": models.resident_bytes, "budget_bytes": models.budget,
            "evictions": models.evictions,
            "cascades": [{"name": name, "tiers": list(c.spec.tiers), **counts.get(name, {"requests": 0})}
                         for name, c in cascades.items()]}


def build_models_app(args: argparse.Namespace, fleet, bind) -> tuple:
    """`serve A B ...`: the models checked and sized, the port bound (`bind(host, port)`, cli.py's);
    returns the app, the sockets and what the start-up line says (cli.py serves them)."""
    from ..config import engine_config_from_args
    from ..model import catalog
    from ..model.load import model_path
    from .dashboard import DashboardOptions
    from .middleware import APIKeyMiddleware, BodySizeLimitMiddleware

    if fleet is not None:
        raise ValueError("--data-parallel-size: not with several models (serve one model per fleet)")
    if args.lora_modules:
        raise ValueError("--lora-modules: with several models, give each model its adapters in its --models-preset "
                         "table (lora_modules = [\"NAME=PATH\"], with enable_lora = true)")
    if args.model is not None:
        raise ValueError("--model: with several models give each as a positional MODEL (or NAME=SOURCE)")
    if args.served_model_name:
        raise ValueError("--served-model-name: with several models name each one as NAME=SOURCE")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    specs = parse_model_specs(args.model_tag or [None]) if args.model_tag or not args.models_preset else []
    preset_cascades = []
    if args.models_preset:
        preset = parse_models_preset(args.models_preset, preset_flags)
        specs, preset_cascades = check_names(specs + preset.models), preset.cascades
        if not specs:
            raise ValueError(f"--models-preset {args.models_preset}: only cascades; give their models too "
                             "(a [NAME] table with `source`, or MODEL on the command line)")
    configs = {s.name: engine_config_from_args(spec_args(args, s)) for s in specs}  # each model's flags checked now
    for spec in specs:  # a bad adapter fails now, as `serve MODEL --lora-modules` fails at start
        where = f"--models-preset {args.models_preset}: [{spec.name}]"
        if spec.lora_modules and not configs[spec.name].enable_lora:
            raise ValueError(f"{where}: lora_modules need enable_lora = true (in its table, or --enable-lora)")
        for lora in spec.lora_modules:
            if not os.path.isdir(lora.lora_path):
                raise ValueError(f"{where}: adapter {lora.lora_name!r}: {lora.lora_path} is not a directory")
    for spec in specs:
        catalog.missing_pull(spec.source)  # a bad source fails now, in one line
    # every served name (aliases, adapters too): a cascade may not take one; a tier may be any
    sources = {name: s.source for s in specs for name in (*s.names, *s.adapters)}
    cascade_specs = parse_cascades(args.cascade, sources, preset_cascades)  # a bad one fails now, before the port
    if not cascade_specs and (args.cascade_config or any(v is not None for v in (
            args.cascade_k, args.cascade_threshold, args.cascade_signal, args.cascade_target_escalation))):
        raise ValueError("--cascade-config/-k/-threshold/-signal/-target-escalation: set for no cascade; add "
                         "--cascade NAME=SMALL,LARGE")
    sockets = bind(args.host, args.port)
    for spec in specs:
        catalog.pull_missing(spec.source)
    try:
        for cascade in cascade_specs:  # the calibration file is checked against the tiers' files, now present
            cascade.rule = build_rule(args, cascade, sources)
    except ValueError:
        for sock in sockets:
            sock.close()
        raise
    cascade_metrics = CascadeMetrics()
    cascades = {c.name: Cascade(c, cascade_metrics, not args.disable_log_requests) for c in cascade_specs}
    estimates = {s.name: estimate_bytes([model_path(s.source), *(r.lora_path for r in s.lora_modules),
                                         *_local(configs[s.name].draft_model)], configs[s.name].kv_cache_memory_bytes)
                 for s in specs}
    budget = args.memory_budget if args.memory_budget is not None else default_budget()
    dashboard = DashboardOptions(not args.disable_dashboard, args.dashboard_max_viewers, args.dashboard_show_text)
    try:
        models = ModelSet(specs, real_loader(args, ForwardTurn(), dashboard), estimates=estimates, budget=budget,
                          models_max=args.models_max, autoload=args.models_autoload,
                          drain_timeout=args.shutdown_timeout, collect=_collect_frozen, rss=rss_bytes,
                          sleep_idle_s=args.sleep_idle_seconds)
    except ModelTooLarge as exc:
        for sock in sockets:
            sock.close()
        raise ValueError(str(exc)) from None
    dashboard.overview = lambda: overview(models, cascades, cascade_metrics)  # every model's page shows them all
    on_start = [s.name for s in specs if s.load_on_startup]  # each loaded at start if it fits beside the ones before it
    front = build_front(models, api_key=args.api_key, metrics_token=args.metrics_token,
                        metrics_open=args.metrics_open, shutdown_timeout=args.shutdown_timeout, on_start=on_start,
                        cascades=cascades, cascade_metrics=cascade_metrics)
    app = MultiModelApp(models, front, args.api_key, cascades)
    wrapped = BodySizeLimitMiddleware(app, max_bytes=args.max_request_body_bytes)
    if args.api_key:
        wrapped = APIKeyMiddleware(wrapped, api_key=args.api_key, operator_token=args.metrics_token)
    wrapped.state = front.state
    logger.info("%d models (%s), memory budget %d bytes, at most %s resident; at start each is loaded that fits",
                len(specs), ", ".join(f"{s.name}={s.source}" for s in specs), budget, args.models_max or "any number")
    for c in cascade_specs:
        logger.info("cascade %s: %s; a tier escalates when %s over its first %d tokens < %s", c.name,
                    " -> ".join(c.tiers), c.rule.signal, c.rule.k, c.rule.threshold)
    return wrapped, sockets, f"{len(specs)} models taking turns at the CPU"
