"""The fleet for Ray Serve's own CLI: `serve run tokenloom.fleet.serve_run:build key=value ...`, each
`key=value` one of `tokenloom serve`'s flags (`data_parallel_size=2` is `--data-parallel-size 2`), so a
Ray cluster an operator already runs can host the same application `tokenloom serve -dp N` starts."""

from __future__ import annotations

import argparse

from ..server.cli import add_serve_parser
from .app import build_fleet, check_fleet_args
from .flags import add_fleet_args


def build(cli_args: dict):
    argv = ["serve"]
    for key, value in cli_args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    parser = argparse.ArgumentParser(prog="serve run tokenloom.fleet.serve_run:build")
    add_fleet_args(add_serve_parser(parser.add_subparsers(dest="command", required=True)))
    args = parser.parse_args(argv)
    check_fleet_args(args)
    return build_fleet(args)
