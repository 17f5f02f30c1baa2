"""The command line answers at once: `tokenloom --help` and every `COMMAND --help` build only the flags of
the command named (cli.py's COMMANDS) and import neither torch nor the server's web stack; the time
each takes is benchmarks/cli_start.py's to measure, not a test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "fastapi", "llguidance", "transformers")
# `python -c` runs main() as the console script does and reports what the help loaded.
PROBE = ("import sys\nfrom tokenloom.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "sys.stderr.write('LOADED ' + ','.join(m for m in {heavy!r} if m in sys.modules) + '\\n')\n")


def loaded_by(*argv: str) -> tuple[str, str]:
    run = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, check=False,
                         cwd=ROOT, timeout=120)
    line = next(x for x in run.stderr.splitlines() if x.startswith("LOADED "))
    return line.removeprefix("LOADED "), run.stdout


@pytest.mark.parametrize("command", ["", "generate", "pull", "models", *COMMANDS])
def test_help_loads_no_heavy_module(command):
    loaded, text = loaded_by(*([command] if command else []), "--help")
    assert loaded == "", (command, loaded)
    assert "usage: tokenloom" in text


def test_the_help_lists_every_command_with_its_line_and_each_command_s_parser_is_built_when_named():
    top = build_parser(["--help"]).format_help()
    for name, (_, summary) in COMMANDS.items():
        assert name in top and summary.split()[0] in top, name
        commands = next(a for a in build_parser([name])._actions if a.dest == "command").choices
        assert len(commands[name]._actions) > 1, name  # its own flags ...
        other = next(n for n in COMMANDS if n != name)
        assert len(commands[other]._actions) == 1, (name, other)  # ... and only -h for the others
    # Every command's full parser, as tests and benchmarks build it (no argv): the same names.
    full = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(COMMANDS) <= set(full)
