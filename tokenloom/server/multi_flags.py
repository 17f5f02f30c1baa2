"""The flags of `tokenloom serve` with several models, and whether a command line asks for them
(multi_serve.py serves them; kept apart so `serve --help` loads no web stack)."""

from __future__ import annotations

import argparse
import os


def add_multi_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", type=int, default=None, metavar="BYTES",
                   help="with several models: bytes the resident models' weights and KV pools may take; loading "
                        "one evicts least-recently-used idle ones (default: 80%% of the memory this process may use)")
    p.add_argument("--models-max", type=int, default=None, metavar="N",
                   help="with several models: at most N resident at once (default: no limit but the budget)")
    p.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="with several models: a request for one not loaded is a 400 naming its status "
                        "(POST /models/load loads it) instead of loading it")


def is_multi(args: argparse.Namespace) -> bool:
    tags = args.model_tag or []
    named = len(tags) == 1 and "=" in tags[0] and not os.path.exists(tags[0])
    return len(tags) > 1 or named or args.memory_budget is not None or args.models_max is not None
