"""Writes everything a lab run set produces into one directory: report.md, PNGs, trace.json, summary.json,
and replay.json.gz when the runs recorded dashboard snapshots."""

from __future__ import annotations

import json
import os
import platform

import torch

from ..bench.workload import WorkloadRequest
from ..engine.snapshot_recording import REPLAY_FILE, write_replay
from .driver import LabResult
from .plots import write_plots
from .report import write_report
from .summary import compare, explain, summarize, workload_ideal_ratio
from .trace import write_trace


def environment() -> str:
    return (
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads."
    )


def pick(summaries: list[dict], mode: str) -> dict | None:
    """The fcfs run of `mode` if there is one, else its first run."""
    runs = [s for s in summaries if s["mode"] == mode]
    return next((s for s in runs if s["policy"] == "fcfs"), runs[0] if runs else None)


def comparisons(summaries: list[dict], requests: list[WorkloadRequest]) -> list[dict]:
    """Continuous vs static (the fcfs runs when present); empty without both modes."""
    continuous, static = pick(summaries, "continuous"), pick(summaries, "static")
    if not (static and continuous):
        return []
    cmp = compare(static, continuous, workload_ideal_ratio(requests, static["batch_size"], static["policy"]))
    cmp["static"] = static["label"]
    cmp["explanation"] = explain(static, continuous, cmp, static["batch_size"])
    return [cmp]


def write_lab_outputs(
    out_dir: str,
    command: str,
    workload: dict,
    requests: list[WorkloadRequest],
    results: list[LabResult],
    forward_plan: str = "",
    model_name: str = "",
) -> dict:
    """`forward_plan`: the model's forward-plan line (`model/plan.py`), named in the report; `model_name`
    goes with it into the replay file."""
    os.makedirs(out_dir, exist_ok=True)
    summaries = [summarize(r) for r in results]
    cmps = comparisons(summaries, requests)
    plots = write_plots(results, summaries, out_dir)
    trace_path = os.path.join(out_dir, "trace.json")
    write_trace(results, trace_path)
    recordings = [r.snapshots for r in results if r.snapshots is not None]
    replay_path = None
    if recordings:
        meta = {"command": command, "model": model_name, "plan": forward_plan, "workload": workload}
        replay_path = write_replay(os.path.join(out_dir, REPLAY_FILE), recordings, meta)
    write_report(
        os.path.join(out_dir, "report.md"),
        command,
        workload,
        summaries,
        cmps,
        plots,
        trace_path,
        environment(),
        forward_plan,
        replay_path,
    )
    data = {"command": command, "forward_plan": forward_plan, "workload": workload, "runs": summaries}
    if cmps:
        data["comparisons"] = cmps
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(data, f, indent=2)
    return data
