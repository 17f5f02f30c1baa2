"""How long `tokenloom --help` and each `tokenloom COMMAND --help` take (issue 58: ≤ 0.5 s on a quiet
machine), the console script as a user runs it, a fresh process each time.

    .venv/bin/python benchmarks/cli_start.py [--runs 7] [--out benchmarks/results/cli-start.md]

Reports the median and the worst of the runs per command, and the load average before and after (a
busy machine's figures say little). tests/test_cli_start.py checks what these helps import.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tokenloom.cli import COMMANDS

BOUND_S = 0.5


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    script = str(Path(sys.executable).with_name("tokenloom"))
    load_before = os.getloadavg()[0]
    rows = []
    for command in ["", "generate", "pull", "models", *COMMANDS]:
        argv = [script, *([command] if command else []), "--help"]
        times = sorted(seconds(argv) for _ in range(args.runs))
        rows.append((" ".join(argv[1:]), statistics.median(times), times[-1]))
    load_after = os.getloadavg()[0]
    lines = ["| command | median | worst |", "|---|---|---|"]
    lines += [f"| `tokenloom {name}` | {med:.3f} s | {worst:.3f} s |" for name, med, worst in rows]
    verdict = all(med <= BOUND_S for _, med, _ in rows)
    summary = (f"{args.runs} runs each; load average {load_before:.2f} before, {load_after:.2f} after; every "
               f"median ≤ {BOUND_S} s: {'yes' if verdict else 'NO'}")
    text = "\n".join(lines) + "\n\n" + summary + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(f"# `--help` start-up times\n\n    .venv/bin/python benchmarks/cli_start.py "
                                  f"--runs {args.runs} --out {args.out}\n\n{text}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
