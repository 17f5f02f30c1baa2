"""`tokenloom dashboard-replay PATH`: its flags, and the command that serves the replay app
(dashboard_replay.py, imported only when it runs: `--help` loads neither FastAPI nor the engine)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 8001  # beside a `tokenloom serve` on 8000


def cmd_dashboard_replay(args: argparse.Namespace) -> int:
    import uvicorn

    from .cli import _bind  # serve's: a busy port is a one-line error, not a traceback
    from .dashboard_replay import PAGE_PATH, build_replay_app

    app = build_replay_app(args.path)
    sockets = _bind(args.host, args.port)
    runs = ", ".join(f"{label} ({n} frames)" for label, n in app.state.replay_runs)
    port = sockets[0].getsockname()[1]
    print(f"replaying {runs}: open http://{args.host}:{port}{PAGE_PATH}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=sockets)
    return 0


def add_replay_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("dashboard-replay")
    p.add_argument("path", metavar="PATH", help="a `tokenloom lab --out` directory or a replay .json.gz file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error", "critical"))
    p.set_defaults(func=cmd_dashboard_replay)
    return p
