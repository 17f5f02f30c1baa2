"""The fleet for Ray Serve's own CLI: `serve run tokenloom.fleet.serve_run:build key=value ...`, each
`key=value` one of `tokenloom serve`'s flags (`data_parallel_size=2` is `--data-parallel-size 2`), so a
Ray cluster an operator already runs can host the same application `tokenloom serve -dp N` starts."""

from __future__ import annotations

from ..cli import build_parser
from .app import build_fleet, check_fleet_args


def build(cli_args: dict):
    argv = ["serve"]
    for key, value in cli_args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = build_parser().parse_args(argv)
    check_fleet_args(args)
    return build_fleet(args)
