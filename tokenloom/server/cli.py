"""`tokenloom serve`: load the engine, start the AsyncLLM thread and uvicorn, exit 0 on SIGTERM/Ctrl-C.
The fleet flags (fleet/flags.py) are added, and a fleet chosen, by the top-level CLI (tokenloom/cli.py).

On SIGTERM or Ctrl-C uvicorn stops accepting connections, waits up to --shutdown-timeout for the
in-flight responses, then the app's lifespan stops the engine thread. uvicorn re-raises a captured
signal after a graceful shutdown (so the exit status would say "killed"); `_Server` keeps the
graceful path but returns normally, so a clean shutdown exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import threading

import uvicorn

from .reasoning import REASONING_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_QUEUE_LEN = 1024  # waiting sequences; beyond it new requests get 503 + Retry-After
DEFAULT_READ_TIMEOUT = 30.0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from ..config import SERVING_DEFAULTS, add_engine_args
    from .multi_flags import add_multi_args

    p = subparsers.add_parser("serve")
    # The model as `vllm serve MODEL` takes it; --model (an engine flag) still works.
    p.add_argument("model_tag", nargs="*", metavar="MODEL", default=None,
                   help="a catalog name (`tokenloom models`; pulled on first use), a GGUF file or an HF directory "
                        "(default: the bundled SmolLM2-135M-Instruct); several (each may be NAME=SOURCE) serve "
                        "them all on one port (server/multi_serve.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TOKENLOOM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /dashboard* "
                        "(default: $TOKENLOOM_API_KEY; unset = no auth)")
    p.add_argument("--metrics-token", default=os.environ.get("TOKENLOOM_METRICS_TOKEN"),
                   help="a scrape-only token: /metrics then needs 'Bearer TOKEN' (not the API key) and shows "
                        "everything; with only --api-key, the key reads /metrics without the prefix-cache "
                        "counters (default: $TOKENLOOM_METRICS_TOKEN)")
    p.add_argument("--metrics-open", action="store_true",
                   help="/metrics without a key (still without the prefix-cache counters when --api-key is set)")
    p.add_argument("--min-client-priority", type=int, default=0,
                   help="the most urgent `priority` a client may send (lower runs sooner; default 0: clients may "
                        "lower their own priority, not jump the queue)")
    p.add_argument("--max-client-priority", type=int, default=1000, help="the largest `priority` a client may send")
    p.add_argument("--trust-chat-messages", action="store_true",
                   help="chat message content may spell control tokens (e.g. <|im_end|>) that take effect, and any "
                        "role goes; default: content is tokenized as text and roles are OpenAI's or the template's")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="a thinking model's <think>...</think> block becomes the chat message's reasoning_content "
                        "(vLLM's flag; default: it stays in content)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model`; /v1/models lists them (default: a catalog name as "
                        "given, else the file's name without .gguf and its quantization suffix)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served by name, as `name=path` or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'; needs --enable-lora; a request picks one by its `model`")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they make the server read "
                        "a directory a client names; default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                   help="reject new requests with 503 + Retry-After while this many sequences wait "
                        f"(default: {DEFAULT_MAX_QUEUE_LEN})")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM/Ctrl-C; the rest end "
                        "with an error (JSON 503, or an SSE error event and [DONE])")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                   help="seconds a connection may take to send a whole request (headers and body); "
                        "slower clients are disconnected")
    p.add_argument("--engine-stall-timeout", type=float, default=120.0,
                   help="seconds one engine step may run before /health says the engine is stalled (503; in a "
                        "fleet the replica is taken out of rotation and replaced)")
    p.add_argument("--disable-dashboard", action="store_true",
                   help="no /dashboard page and stream (404); the dashboard obeys /metrics' rule (with "
                        "--metrics-token only that token opens it; with --api-key alone the key, without the "
                        "prefix-cache counters and block map)")
    p.add_argument("--dashboard-max-viewers", type=positive_int, default=16,
                   help="dashboard streams open at once; beyond it 503 + Retry-After (default: 16)")
    p.add_argument("--dashboard-max-viewers-per-client", type=positive_int, default=4,
                   help="with auth on, dashboard streams one client address may hold; beyond it 429 (default: 4)")
    p.add_argument("--dashboard-show-text", action="store_true",
                   help="show prompts and outputs on the dashboard to the --metrics-token holder only (needs "
                        "--metrics-token; default: request ids, counts and times only)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="every request's time-to-first-token target unless its body or class sets one (ms); "
                        "/metrics counts who met it (slo_attained_total), --scheduling-policy slo aims at it")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="the default time-per-output-token target (ms)")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="the default arrival-to-last-token target (ms)")
    p.add_argument("--slo-classes", metavar="FILE", default=None,
                   help="JSON: SLO classes and which tenant (`user`) has which, e.g. {\"classes\": {\"batch\": "
                        "{\"ttft_ms\": 60000}}, \"tenants\": {\"etl\": \"batch\"}, \"default_class\": null} (README)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between engine status lines")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    p.add_argument("--record-steps", metavar="FILE", default=None,
                   help="append each engine step's batch shape and wall time to FILE (JSON lines; a fleet's "
                        "replicas each write FILE with their pid before the suffix), for `tokenloom calibrate "
                        "--from-steps`")
    add_multi_args(p)
    add_engine_args(p)
    # Serving takes the fastest weights that passed the quality check (int4 where it runs, with a
    # float32 residual); --quantization none gives the exact float32 path. Prefill slices are sized
    # stall-free (decodes slow down at most 1.5x while a prompt prefills); --stall-free-factor 0: off.
    p.set_defaults(func=cmd_serve, **SERVING_DEFAULTS)
    return p


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bind(host: str, port: int) -> list[socket.socket]:
    """The listening sockets, bound before the model loads (seconds to minutes): a busy port fails at
    once instead of after the load, and nothing can take the port meanwhile. uvicorn listens on them
    once the app starts (until then a connection is refused, so /health cannot pass early)."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and asyncio do
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        why = ("is in use (another server?); choose another --port" if exc.errno == errno.EADDRINUSE
               else f"cannot be bound: {exc.strerror or exc}")
        raise ValueError(f"--host {host} --port {port}: {why}") from None
    return sockets


def cmd_serve(args: argparse.Namespace, fleet=None) -> int:
    """One server process; `fleet` (given by the top-level CLI, tokenloom/cli.py, when the flags ask for
    one) is `(start, stop)`: `start(args, config)` returns the front app of a fleet of engine replicas,
    served here in place of one engine, and `stop()` ends the fleet."""
    from ..config import engine_config_from_args
    from ..model import catalog
    from .app import build_app
    from .dashboard import DashboardOptions
    from .loading import app_options, load_served_engine, warn_unreachable_slos
    from .lora_routes import parse_lora_modules
    from .multi_flags import is_multi
    from .multi_serve import build_models_app

    if is_multi(args):
        return _serve(args, *build_models_app(args, fleet, _bind))
    args.model_tag = args.model_tag[0] if args.model_tag else None
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}; pass one")
        args.model = args.model_tag
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules: adapters need --enable-lora")
    if args.dashboard_show_text and not args.metrics_token:
        raise ValueError("--dashboard-show-text: prompt and output text go only to the holder of --metrics-token; "
                         "set one")
    # Everything that can fail in a second fails before the model loads: the source, then the port.
    to_pull = catalog.missing_pull(config.model)
    draft_to_pull = catalog.missing_pull(config.draft_model, "speculative_config.model")
    options = app_options(args)  # a bad SLO flag or classes file fails before the port and the load too
    sockets = _bind(args.host, args.port)
    if fleet is not None:
        start_fleet, stop_fleet = fleet
        try:
            return _serve(args, start_fleet(args, config), sockets, "a fleet")
        finally:
            stop_fleet()
    for name in (to_pull, draft_to_pull):
        catalog.pull_missing(name)
    served = load_served_engine(args, config, lora_modules)
    warn_unreachable_slos(served.async_llm.engine, options["slo_policy"])
    app = build_app(
        served.async_llm, served.names, metrics=served.metrics, model_path=served.path,
        lora_modules=lora_modules, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        dashboard=DashboardOptions(not args.disable_dashboard, args.dashboard_max_viewers, args.dashboard_show_text,
                                   args.dashboard_max_viewers_per_client),
        **options,
    )
    return _serve(args, app, sockets, f"torch threads {served.async_llm.num_threads}")


def _serve(args: argparse.Namespace, app, sockets: list[socket.socket], what: str) -> int:
    """uvicorn on the bound sockets until SIGTERM/Ctrl-C (a graceful stop: exit 0)."""
    logging.getLogger("tokenloom.server").info(
        "serving %s on http://%s:%d (%s, auth %s; %s)", app.state.tokenloom.model_name, args.host,
        sockets[0].getsockname()[1], what, "on" if args.api_key else "off",
        getattr(app.state, "access_line", "engine state: see /metrics"))
    from .connection import connection_limits  # read/idle timeouts, header size bound

    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + 5.0,  # a backstop: the app answers by the deadline
        **connection_limits(args.request_read_timeout),
    ))
    server.run(sockets=sockets)
    return 0


class _Server(uvicorn.Server):
    """uvicorn.Server whose signal handling does not re-raise the signal after a clean shutdown,
    and tells the app at once (it refuses new requests and starts the shutdown deadline)."""

    def handle_exit(self, sig, frame) -> None:
        begin = getattr(getattr(self.config.app, "state", None), "begin_shutdown", None)
        if begin is not None:
            begin()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
