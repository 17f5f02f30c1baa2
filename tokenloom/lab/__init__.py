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

from .cli import add_lab_parser
from .driver import LabResult, LabRun, run_workload, run_workloads
from .ideal import ideal_ratio, static_batch_steps

__all__ = [
    "LabResult",
    "LabRun",
    "add_lab_parser",
    "ideal_ratio",
    "run_workload",
    "run_workloads",
    "static_batch_steps",
]
