"""The batching lab: one workload through static, dynamic and continuous batching, side by side.

`tokenloom lab --workload mixed --out DIR` runs in-process on the real model and writes a report
(table, plots, Chrome trace). Modules, one job each:

- `workloads`: the request sets (mixed, uniform, long-prompt) with their output lengths.
- `ideal`: the ideal continuous/static throughput ratio of a workload (pure math).
- `recorder`: a step listener that records every step and every request of a run.
- `slots`: batch-slot assignment for the slot timeline (static keeps finished slots idle).
- `runner`: drives engines over a workload (runs interleaved step by step) into `RunResult`s.
- `summary`: throughput, latency, TTFT and occupancy of a run.
- `plots`, `trace`, `report`: PNG plots, Chrome-trace JSON, report.md.
- `cli`: `add_lab_parser` for the `tokenloom lab` command.
"""

from __future__ import annotations

from .cli import add_lab_parser
from .ideal import ideal_ratio, static_batch_steps
from .runner import LabRun, RunResult, run_workload, run_workloads
from .workloads import LabRequest, make_workload

__all__ = [
    "LabRequest",
    "LabRun",
    "RunResult",
    "add_lab_parser",
    "ideal_ratio",
    "make_workload",
    "run_workload",
    "run_workloads",
    "static_batch_steps",
]
