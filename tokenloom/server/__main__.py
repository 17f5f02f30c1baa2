"""`python -m tokenloom.server [serve] ...`: the serve command, one process, without the rest of the CLI (a fleet,
`--data-parallel-size N`, is `tokenloom serve`'s: tokenloom/cli.py)."""

from __future__ import annotations

import argparse
import sys

from .cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m tokenloom.server")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parser.parse_args(["serve", *argv])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
