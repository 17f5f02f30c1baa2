"""Where a benchmark's per-run files go (server logs, each cell's `bench serve` output, recorded steps).

They are not results: `benchmarks/results/` keeps each result's summary (a small JSON, its `.md`) and its
command, and the per-run files go to a folder the user chooses, by default `benchmarks/runs/<name>/`,
which git ignores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"


def add_raw_dir_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--raw-dir", default=None,
                    help="folder for the per-run files (logs, each cell's output); default: benchmarks/runs/"
                         "<the --out file's name without its suffix>, ignored by git")


def raw_dir(chosen: str | None, out: Path) -> Path:
    """The chosen folder, else benchmarks/runs/<out's stem>; created."""
    raw = Path(chosen) if chosen else RUNS / out.stem
    raw.mkdir(parents=True, exist_ok=True)
    return raw
