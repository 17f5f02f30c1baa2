"""`python -m tokenloom.lab ...` = `tokenloom lab ...` (usable before `lab` is wired into the CLI)."""

from __future__ import annotations

import argparse
import shlex
import sys

from .cli import add_lab_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloom")
    add_lab_parser(parser.add_subparsers(dest="command", required=True))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(["lab", *argv])
    args.command_line = "tokenloom lab " + shlex.join(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
