"""The batching lab: one workload through static, dynamic and continuous batching, side by side.

`tokenloom lab --workload mixed --out DIR` runs in-process on the real model and writes a report
(table, plots, Chrome trace). Workloads (mixed, uniform, long-prompt, poisson) are
`tokenloom.bench.workload`'s, shared with the simulator and the benchmarks. Modules, one job each:

- `ideal`: the ideal continuous/static throughput ratio of a workload (pure math).
- `recorder`: a step listener that records every step and every request of a run.
- `slots`: batch-slot assignment for the slot timeline (static keeps finished slots idle).
- `driver`: drives engines over a workload (runs interleaved step by step, each a
  `tokenloom.bench.replay.Replay`) into `LabResult`s.
- `progress`: a progress line per run on stderr every few seconds.
- `summary`: throughput, latency, TTFT and occupancy of a run.
- `plots`, `trace`, `report`: PNG plots, Chrome-trace JSON, report.md.
- `cli`: `add_lab_parser` for the `tokenloom lab` command.
"""

from __future__ import annotations

import importlib

# Each name is imported when first asked for (PEP 562): `tokenloom lab --help` reads the flags in `cli`
# without loading the engine and torch that `driver` needs.
_HOME = {"add_lab_parser": "cli", "LabResult": "driver", "LabRun": "driver", "run_workload": "driver",
         "run_workloads": "driver", "ideal_ratio": "ideal", "static_batch_steps": "ideal"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


__all__ = [
    "LabResult",
    "LabRun",
    "add_lab_parser",
    "ideal_ratio",
    "run_workload",
    "run_workloads",
    "static_batch_steps",
]
