"""The batching lab on the tiny random model: ideal-ratio math, slot assignment, report files."""

from __future__ import annotations

import io
import json

import pytest

from tokenloom.bench.workload import WorkloadRequest, make_workload
from tokenloom.engine.snapshot_recording import read_replay
from tokenloom.lab import (
    LabRun,
    ideal_ratio,
    run_workload,
    run_workloads,
    static_batch_steps,
)
from tokenloom.lab.output import write_lab_outputs
from tokenloom.lab.plots import slot_figure
from tokenloom.lab.progress import LabProgress
from tokenloom.lab.recorder import StepRecord
from tokenloom.lab.slots import assign_slots
from tokenloom.lab.summary import summarize, workload_ideal_ratio

TINY_ENGINE = {"max_model_len": 1024, "num_kv_blocks": 256}


def test_ideal_ratio_hand_computed():
    # B = 2: batches [16, 256] and [16, 16] -> 256 + 16 = 272 static steps; 304 tokens / 2 = 152.
    assert static_batch_steps([16, 256, 16, 16], 2) == 272
    assert ideal_ratio([16, 256, 16, 16], 2) == pytest.approx(272 / 152)
    # Equal lengths: static is already ideal.
    assert ideal_ratio([128] * 16, 8) == pytest.approx(1.0)
    # The workload shape: every batch of 8 holds a 256 -> 8 * 256 / (64 * 136 / 8) = 1.882.
    lens = [16, 256] * 32
    assert ideal_ratio(lens, 8) == pytest.approx(2048 / 1088)


def test_ideal_ratio_follows_admission_order():
    reqs = [WorkloadRequest(f"r{i}", [1, 2], n) for i, n in enumerate([256, 16, 256, 16])]
    assert workload_ideal_ratio(reqs, 2, "fcfs") == pytest.approx(512 / 272)
    assert workload_ideal_ratio(reqs, 2, "sjf") == pytest.approx(272 / 272)  # SJF groups the short ones


def _step(i, running, finished=()):
    return StepRecord(i, float(i), 1.0, 0.5, len(running), len(running), 0, list(running), list(finished))


def test_slots_static_keeps_finished_slots_idle():
    steps = [
        _step(0, ["a", "b"]),
        _step(1, ["a", "b"], ["a"]),
        _step(2, ["b"]),
        _step(3, ["b"], ["b"]),
        _step(4, ["c", "d"]),
    ]
    tl = assign_slots(steps, hold_until_batch_end=True)
    assert tl.slot_of == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert tl.owners[2] == ["a", "b"] and tl.active[2] == [False, True]  # a's slot held idle (padding)
    assert tl.idle_slot_steps() == 2
    assert tl.active[4] == [True, True]


def test_slots_continuous_reuses_lowest_free_slot():
    steps = [
        _step(0, ["a", "b"], ["a"]),
        _step(1, ["b", "c"]),
        _step(2, ["b", "c", "d"], ["b"]),
        _step(3, ["c", "d", "e"]),
    ]
    tl = assign_slots(steps, hold_until_batch_end=False)
    assert tl.slot_of == {"a": 0, "b": 1, "c": 0, "d": 2, "e": 1}
    assert tl.num_slots == 3 and tl.idle_slot_steps() == 0


def test_workloads_are_seeded_and_shaped():
    reqs = make_workload("mixed", 8, seed=1)
    assert sorted(r.max_tokens for r in reqs) == [16] * 4 + [256] * 4
    assert reqs == make_workload("mixed", 8, seed=1)
    assert all(len(r.prompt_token_ids) >= 384 for r in make_workload("long-prompt", 4))
    with pytest.raises(ValueError, match="workload"):
        make_workload("bursty", 4)


def test_lab_run_writes_report(tiny_model, tokenizer, tmp_path):
    reqs = make_workload("mixed", 6, seed=0, output_lens=(2, 9))
    runs = [LabRun(mode, 2, max_wait_ms=5.0) for mode in ("static", "dynamic", "continuous")]
    lines = io.StringIO()
    progress = LabProgress(interval_s=0.0, stream=lines)  # a line per run after every turn
    results = run_workloads(tiny_model, tokenizer, reqs, runs, progress=progress, max_frames=6, **TINY_ENGINE)
    summaries = [summarize(r) for r in results]
    for s in summaries:
        assert s["num_requests"] == 6 and s["output_tokens"] == sum(r.max_tokens for r in reqs)
        assert 0 < s["occupancy"] <= 1 and s["max_running"] <= 2
    static, continuous = summaries[0], summaries[2]
    assert static["num_steps"] == static_batch_steps([r.max_tokens for r in reqs], 2)
    assert static["idle_slot_steps"] > 0 and continuous["idle_slot_steps"] == 0
    assert continuous["num_steps"] < static["num_steps"]

    printed = lines.getvalue().splitlines()
    for res in results:  # every run moved on screen, and said when it was done
        own = [line for line in printed if f"] {res.label} " in line]
        assert len(own) > 2, printed
        assert "done requests    6/6" in own[-1] and f"steps {len(res.steps):>6}" in own[-1]
        assert sum("done" in line for line in own) == 1

    data = write_lab_outputs(
        str(tmp_path), "tokenloom lab --workload mixed", {"name": "mixed"}, reqs, results,
        forward_plan=tiny_model.plan.line(),
    )
    report = (tmp_path / "report.md").read_text()
    assert "tokenloom lab --workload mixed" in report and "ideal ratio" in report
    assert f"Forward path (the engine's start-up line): `{tiny_model.plan.line()}`" in report
    assert data["forward_plan"].startswith("forward plan: ")
    replay = read_replay(str(tmp_path))  # the directory: replay.json.gz inside
    assert [r["label"] for r in replay["runs"]] == ["static", "dynamic", "continuous"]
    for run, res in zip(replay["runs"], results, strict=True):
        frames = run["frames"]
        assert 3 <= len(frames) <= 6  # bounded by max_frames
        numbers = [f["step"]["number"] for f in frames]
        assert numbers == sorted(set(numbers)) and numbers[-1] == run["num_steps"]  # the last step kept
        assert frames[-1]["timeline"] and all("kv" in f and "running" in f for f in frames)
    for png in ("throughput.png", "latency_cdf.png", "occupancy.png", "slot_timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"step", "request"}
    assert sum(e["cat"] == "request" for e in spans) == 3 * 6
    assert [c["static"] for c in data["comparisons"]] == ["static"]
    assert data["comparisons"][0]["ideal_ratio"] == pytest.approx(workload_ideal_ratio(reqs, 2))


def test_lab_parser_registers_command():
    import argparse

    from tokenloom.lab import add_lab_parser

    parser = argparse.ArgumentParser()
    add_lab_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lab", "--workload", "uniform", "--policies", "fcfs,sjf", "--out", "x"])
    assert args.policies == ["fcfs", "sjf"] and callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["lab", "--policies", "lifo", "--out", "x"])


def test_lab_and_calibrate_take_serves_forward_flags_and_defaults():
    from tokenloom.cli import build_parser
    from tokenloom.config import FORWARD_PATH_FIELDS, forward_path_from_args

    parser = build_parser()
    serve = forward_path_from_args(parser.parse_args(["serve"]))
    lab = forward_path_from_args(parser.parse_args(["lab", "--out", "x"]))
    calibrate = forward_path_from_args(parser.parse_args(["calibrate"]))
    assert lab == serve == calibrate and serve["quantization"] == "auto"  # not the library's float32
    flags = ["--model", "m.gguf", "--dtype", "bfloat16", "--quantization", "none", "--kv-cache-dtype", "float32",
             "--num-threads", "1"]
    assert forward_path_from_args(parser.parse_args(["lab", *flags, "--out", "x"])) == forward_path_from_args(
        parser.parse_args(["serve", *flags]))
    assert set(FORWARD_PATH_FIELDS) <= set(vars(parser.parse_args(["lab", "--out", "x"])))
    with pytest.raises(SystemExit):  # serve's choices, serve's error
        parser.parse_args(["lab", "--quantization", "int3", "--out", "x"])


def test_slot_timeline_panels_each_show_their_whole_run(tiny_model, tokenizer):
    reqs = make_workload("mixed", 4, seed=0, output_lens=(2, 12))
    runs = [LabRun(mode, 2) for mode in ("static", "continuous")]
    results = run_workloads(tiny_model, tokenizer, reqs, runs, **TINY_ENGINE)
    assert len(results[0].steps) > len(results[1].steps)  # static runs longer
    fig = slot_figure(results)
    for ax, res in zip(fig.axes, results, strict=True):
        assert ax.get_xlim() == (0, len(res.steps)) and ax.get_xlabel() == "step"


def test_engine_clock_runs_only_during_turns():
    import time

    from tokenloom.lab.driver import EngineClock

    clock = EngineClock()
    assert clock() == 0.0
    clock.resume()
    time.sleep(0.01)
    clock.pause()
    paused_at = clock()
    assert paused_at >= 0.01
    time.sleep(0.01)
    assert clock() == paused_at
    clock.skip(1.5)
    assert clock() == pytest.approx(paused_at + 1.5)


def test_dynamic_batch_waits_for_its_timer(tiny_model, tokenizer):
    # Two requests 0.2 s apart on the engine clock, B = 4: dynamic waits max_wait_ms for company.
    reqs = [
        WorkloadRequest("a", [300, 301], 3, arrival_time=0.0),
        WorkloadRequest("b", [302, 303], 3, arrival_time=0.2),
    ]
    res = run_workload(tiny_model, tokenizer, reqs, LabRun("dynamic", 4, max_wait_ms=50.0), **TINY_ENGINE)
    a, b = res.requests["a"], res.requests["b"]
    assert a.first_scheduled == pytest.approx(0.05, abs=0.01)  # alone after its 50 ms wait
    assert b.first_scheduled >= max(0.25, a.finished) - 1e-9


def test_progress_prints_every_interval_and_once_when_a_run_ends():
    from types import SimpleNamespace

    now = [0.0]
    out = io.StringIO()
    progress = LabProgress(interval_s=5.0, stream=out, clock=lambda: now[0])
    runs = [SimpleNamespace(label=label, done=False, finished_requests=0, total_requests=4, generated_tokens=0,
                            total_tokens=64, steps=0, engine_seconds=0.0) for label in ("static", "continuous")]
    for t in (1.0, 4.9):  # within the interval: quiet
        now[0] = t
        progress.update(runs)
    assert out.getvalue() == ""
    now[0], runs[0].generated_tokens, runs[0].steps = 5.0, 32, 32
    progress.update(runs)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "static" in lines[0] and "tokens 32/64 ( 50%)" in lines[0] and "[    5.0 s]" in lines[0]
    now[0], runs[1].done, runs[1].finished_requests = 6.0, True, 4
    progress.update(runs)  # a run that ends says so at once, once
    now[0] = 11.0
    progress.update(runs)  # and is not repeated by the periodic lines
    lines = out.getvalue().splitlines()
    assert [line.split()[3:5] for line in lines[2:]] == [["continuous", "done"], ["static", "requests"]]
