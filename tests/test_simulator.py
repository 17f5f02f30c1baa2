"""The simulator drives the real scheduler and KV cache on a virtual clock (no model, fast)."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from tokenloom.bench.replay import Replay, replay
from tokenloom.bench.workload import WorkloadRequest, make_workload
from tokenloom.config import EngineConfig
from tokenloom.engine.cost_model import LinearCostModel, StepFeatures, fit_linear, nnls
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.cost_model import load_cost_model, preset, save_cost_model
from tokenloom.sim.simulator import build_sim_engine, simulate


def const_model(step_s: float) -> LinearCostModel:
    return LinearCostModel(step_s, {})


def test_tiny_case_exact_times(tokenizer):
    """Budget 8, steps of exactly 0.1 s. Request 0 (prompt 10, 3 tokens) arrives at 0, request 1
    (prompt 4, 2 tokens) at 0.15 s.
    step 1 [0.0, 0.1]: r0 chunk 8.        step 2 [0.1, 0.2]: r0 last 2 -> token 1.
    step 3 [0.2, 0.3]: r0 decode (token 2) + r1 prefill 4 -> r1 token 1.
    step 4 [0.3, 0.4]: r0 token 3 (done), r1 token 2 (done)."""
    wl = [WorkloadRequest("r0", [1000 + i for i in range(10)], 3),
          WorkloadRequest("r1", [2000, 2001, 2002, 2003], 2, arrival_time=0.15)]
    cfg = EngineConfig(max_num_batched_tokens=8, max_model_len=64)
    res = simulate(const_model(0.1), wl, cfg, tokenizer=tokenizer)
    r0, r1 = res.requests
    assert res.num_steps == 4
    assert r0.ttft == pytest.approx(0.2) and r0.latency == pytest.approx(0.4)
    assert r0.itl == pytest.approx([0.1, 0.1])
    assert r1.start_time == pytest.approx(0.15)
    assert r1.ttft == pytest.approx(0.15) and r1.latency == pytest.approx(0.25)
    assert res.duration == pytest.approx(0.4)
    assert res.metrics.output_throughput == pytest.approx(5 / 0.4)
    assert res.metrics.latency_stats["median_tpot_ms"] == pytest.approx(100.0)


def test_idle_clock_jumps_to_next_arrival(tokenizer):
    wl = [WorkloadRequest("r0", [1000] * 4, 2), WorkloadRequest("r1", [1001] * 4, 2, arrival_time=10.0)]
    res = simulate(const_model(0.01), wl, EngineConfig(max_model_len=64), tokenizer=tokenizer)
    assert res.requests[1].start_time == 10.0
    assert res.requests[1].ttft == pytest.approx(0.01)
    assert res.duration == pytest.approx(10.02)
    assert res.num_steps == 4


@pytest.mark.parametrize("arrival", [0.1, 0.2, 0.3, 0.7])
def test_dynamic_batch_opens_at_its_timer_on_a_virtual_clock(tokenizer, arrival):
    """The replay jumps to the dynamic batch's timer; at that very time the batch must open (0.1 + 0.01
    - 0.1 is a hair under 0.01 in floats: a check that computed it so kept the batch shut forever)."""
    engine, _ = build_sim_engine(const_model(0.005), EngineConfig(batching="dynamic", max_num_seqs=4, max_wait_ms=10.0))
    run = Replay(engine, [WorkloadRequest("a", [300, 301], 3, arrival_time=arrival)])
    for _ in range(20):
        run.turn()
    assert run.done
    assert run.result().requests[0].ttft == pytest.approx(0.01 + 0.005)  # its wait, then one step


def test_continuous_beats_static_on_mixed(tokenizer):
    wl = make_workload("mixed", 24, 32, seed=0)
    cost = LinearCostModel(0.005, {"tokens": 2e-5, "decode_kv": 1e-8})
    out = {}
    for mode in ("continuous", "dynamic", "static"):
        cfg = EngineConfig(batching=mode, max_num_seqs=8, max_wait_ms=10)
        out[mode] = simulate(cost, wl, cfg, tokenizer=tokenizer).metrics
    assert out["continuous"].output_throughput > 1.3 * out["static"].output_throughput
    assert out["dynamic"].output_throughput <= out["continuous"].output_throughput
    assert out["continuous"].total_output_tokens == sum(r.max_tokens for r in wl)


def test_kv_blocks_all_free_and_preemption_under_pressure(tokenizer):
    wl = make_workload("uniform", 16, 48, 64, seed=1)
    cfg = EngineConfig(num_kv_blocks=24, block_size=16, max_model_len=128)
    engine, _ = build_sim_engine(const_model(0.01), cfg, tokenizer=tokenizer)
    res = replay(engine, wl, on_step=engine.check_kv_invariants)
    assert res.metrics.completed == 16 and res.metrics.total_output_tokens == 16 * 64
    assert engine.scheduler.num_preemptions > 0  # 24 blocks cannot hold 16 x 7 blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.has_unfinished_requests()


def test_simulation_records_dashboard_frames_on_its_virtual_clock(tokenizer):
    wl = make_workload("uniform", 16, 48, 64, seed=1)
    cfg = EngineConfig(num_kv_blocks=24, block_size=16, max_model_len=128)
    res = simulate(const_model(0.01), wl, cfg, tokenizer=tokenizer, record_frames=20)
    frames = res.snapshots.frames
    assert 10 <= len(frames) <= 20 and frames[-1]["step"]["number"] == res.num_steps
    assert [f["now"] for f in frames] == sorted(f["now"] for f in frames)  # virtual seconds, moving on
    assert frames[-1]["now"] == pytest.approx(res.duration, abs=0.011)
    assert max(f["num_preemptions"] for f in frames) > 0  # the KV pressure shows in the frames
    assert simulate(const_model(0.01), wl[:2], cfg, tokenizer=tokenizer).snapshots is None  # off by default


def test_fit_recovers_known_coefficients():
    rng = random.Random(0)
    true = {"tokens": 2e-4, "sampled": 5e-5, "seqs": 0.0, "prefill_seqs": 1e-3, "decode_kv": 3e-7,
            "prefill_attn": 4e-9}
    samples = []
    for _ in range(300):
        f = StepFeatures(tokens=rng.randint(1, 512), sampled=rng.randint(0, 64), seqs=rng.randint(1, 64),
                         prefill_seqs=rng.randint(0, 4), decode_kv=rng.randint(0, 64 * 1024),
                         prefill_attn=rng.randint(0, 512 * 1024))
        d = 0.004 + sum(c * getattr(f, k) for k, c in true.items())
        samples.append((f, d * (1 + rng.gauss(0, 0.002))))
    model = fit_linear(samples)
    assert model.intercept == pytest.approx(0.004, rel=0.05)
    for k, c in true.items():
        assert model.coef[k] == pytest.approx(c, rel=0.05, abs=1e-6)
    assert model.fit_stats["r2"] > 0.999


def test_nnls_matches_unconstrained_when_positive_and_clips_otherwise():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])
    x = nnls(a, np.array([1.0, -2.0, -1.0]))
    assert (x >= 0).all() and x[1] == 0


def test_cost_model_json_round_trip(tmp_path):
    lin = LinearCostModel(0.01, {"tokens": 1e-4}, {"samples": 3}, "test")
    save_cost_model(lin, tmp_path / "c.json", {"note": "x"})
    assert json.loads((tmp_path / "c.json").read_text())["note"] == "x"
    again = load_cost_model(tmp_path / "c.json")
    f = StepFeatures(tokens=100)
    assert again.predict(f) == pytest.approx(lin.predict(f))
    roof = preset("llama-3-8b@h100")
    save_cost_model(roof, tmp_path / "r.json")
    assert load_cost_model(tmp_path / "r.json").predict(f) == pytest.approx(roof.predict(f))


def test_roofline_preset_physics():
    roof = preset("llama-3-8b@a100")
    # Decode at batch 1 is memory-bound: ~16 GB of bf16 weights at 0.8 x 2.039 TB/s, ~10 ms + overhead.
    one = roof.predict(StepFeatures(tokens=1, sampled=1, seqs=1, attn_pairs=100, kv_read=100))
    assert 0.010 < one < 0.016
    assert roof.kv_bytes_per_token == 128 * 1024
    # A 4096-token prefill is compute-bound: ~2 x 7e9 x 4096 FLOPs at 0.5 x 312 TFLOP/s, ~0.37 s.
    big = roof.predict(StepFeatures(tokens=4096, sampled=1, seqs=1, attn_pairs=4096 * 2048, kv_read=4096))
    assert 0.3 < big < 0.5
    assert preset("llama-3-70b@h100x4").num_gpus == 4
    with pytest.raises(ValueError, match="preset"):
        preset("gpt-5@h100")
    with pytest.raises(ValueError, match="does not fit"):
        preset("llama-3-70b@l4x1").kv_memory_bytes()


def test_preset_simulation_runs_bigger_model(tokenizer):
    roof = preset("llama-3-8b@h100")
    cfg = EngineConfig(dtype="bfloat16", kv_cache_memory_bytes=roof.kv_memory_bytes(), max_model_len=4096)
    wl = make_workload("poisson", 40, 512, 64, request_rate=20.0, seed=0)
    res = simulate(roof, wl, cfg, tokenizer=tokenizer)
    assert res.metrics.completed == 40
    assert 0.004 < res.metrics.latency_stats["median_tpot_ms"] / 1000 < 0.05


def test_workloads_are_seeded_and_shaped():
    a = make_workload("poisson", 20, 16, 8, request_rate=4.0, seed=5)
    assert a == make_workload("poisson", 20, 16, 8, request_rate=4.0, seed=5)
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and times[-1] == pytest.approx(20 / 4.0)
    mixed = make_workload("mixed", 10, 16, seed=0)
    assert sorted(r.max_tokens for r in mixed) == [16] * 5 + [256] * 5
    assert all(r.arrival_time == 0 for r in mixed)
    with pytest.raises(ValueError, match="request_rate"):
        make_workload("poisson", 4, 16, 8, request_rate=math.inf)


def test_cli_simulate_json(capsys):
    from tokenloom.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    if "simulate" not in sub.choices:
        from tokenloom.sim.cli import add_simulate_parser

        add_simulate_parser(sub)
    args = parser.parse_args(["simulate", "--preset", "llama-3-8b@h100", "--workload", "uniform",
                              "--num-prompts", "8", "--input-len", "64", "--output-len", "8", "--json"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 8 and report["engine"]["dtype"] == "bfloat16"


def test_calibrate_on_tiny_model_then_simulate(make_engine, tokenizer):
    """The calibration loop (recorder, grid, fit) on the tiny random-weight model; the recorder leaves the
    engine's runner as it found it, and the fitted model drives the simulator."""
    from tokenloom.sim.calibrate import calibrate

    engine = make_engine(num_kv_blocks=512)
    runner = engine.runner
    grid = [(1, 16, 8), (2, 96, 4), (4, 32, 8), (8, 24, 8), (16, 8, 6)]
    model, samples = calibrate(engine, quick=True, log=lambda _msg: None, grid=grid)
    assert engine.runner is runner and not engine.step_listeners
    assert len(samples) > 25 and all(d > 0 for _, d in samples)
    assert model.predict(StepFeatures(tokens=1, sampled=1, seqs=1)) > 0
    res = simulate(model, make_workload("uniform", 4, 16, 4), EngineConfig(max_model_len=64), tokenizer=tokenizer)
    assert res.metrics.completed == 4


def test_served_steps_recorded_then_fitted(make_engine, tmp_path):
    """`--record-steps` on the tiny model: every step that ran tokens is a line, and `calibrate --from-steps`
    fits a model on them that predicts those steps' times."""
    from tokenloom.engine.step_log import StepLog, read_step_logs

    engine = make_engine(num_kv_blocks=512)
    log = StepLog(engine, str(tmp_path / "steps.jsonl"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rng = random.Random(0)
    for i, n in enumerate((8, 40, 16, 90, 24, 3, 64, 12)):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(100) for _ in range(n)]}, params)
        for _ in range(i % 3):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    log.close()
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    samples = read_step_logs([str(tmp_path / "steps.jsonl")])
    assert len(samples) == len(lines) > 10 and all(d > 0 for _, d in samples)
    assert sum(f.tokens for f, _ in samples) == 8 + 40 + 16 + 90 + 24 + 3 + 64 + 12 + 8 * 5
    out = tmp_path / "cal.json"
    _cli(["calibrate", "--from-steps", str(tmp_path / "steps.jsonl"), "--out", str(out)])
    model = load_cost_model(out)
    assert model.fit_stats["samples"] >= 0.8 * len(samples) and model.predict(samples[0][0]) > 0


def test_a_busy_step_lasts_until_the_next_one_starts():
    from tokenloom.engine.step_log import busy_step_times

    f = StepFeatures(tokens=1, sampled=1, seqs=1)
    records = [{"start": 0.0, "end": 1.0, "busy_after": True, "features": f},
               {"start": 1.25, "end": 2.0, "busy_after": False, "features": f},  # the loop's 0.25 s counts
               {"start": 5.0, "end": 5.5, "busy_after": True, "features": f}]  # the idle 3 s does not
    assert [d for _, d in busy_step_times(records)] == [1.25, 0.75, 0.5]


def test_a_step_log_that_is_not_one_is_named(tmp_path):
    from tokenloom.engine.step_log import read_step_logs

    bad = tmp_path / "steps.jsonl"
    bad.write_text('{"start": 0, "end": 1, "busy_after": false, "features": {"tokens": 1}}\n{"start": 2}\n')
    with pytest.raises(ValueError, match=r"steps.jsonl line 2 is not a step record"):
        read_step_logs([str(bad)])
    bad.write_text('{"start": 0, "end": 1, "busy_after": false, "features": {"bogus": 1}}\n')
    with pytest.raises(ValueError, match=r"line 1 is not a step record"):
        read_step_logs([str(bad)])
    with pytest.raises(ValueError, match=r"--from-steps: cannot read .*missing.jsonl"):
        read_step_logs([str(tmp_path / "missing.jsonl")])


def test_a_step_log_that_cannot_be_written_is_named(make_engine, tmp_path):
    from tokenloom.engine.step_log import StepLog

    engine = make_engine()
    with pytest.raises(ValueError, match=r"--record-steps: cannot write .*no-such-dir"):
        StepLog(engine, str(tmp_path / "no-such-dir" / "steps.jsonl"))
    assert not engine.step_listeners


def _cli(argv: list[str]) -> int:
    from tokenloom.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def test_a_measured_spread_scales_step_times_and_survives_json(tmp_path):
    from tokenloom.engine.cost_model import with_spread

    model = const_model(0.010)
    f = StepFeatures(tokens=1, sampled=1, seqs=1)
    samples = [(f, 0.010)] * 50 + [(f, 0.020)] * 50  # half the steps took twice their prediction
    spread = with_spread(model, samples)
    assert spread.spread[0] == pytest.approx(1.0) and spread.spread[-1] == pytest.approx(2.0)
    rng = random.Random(0)
    draws = [spread.step_time(f, rng) for _ in range(2000)]
    assert min(draws) >= 0.010 - 1e-12 and max(draws) <= 0.020 + 1e-12
    assert statistics.mean(draws) == pytest.approx(0.015, rel=0.05)
    assert model.step_time(f, rng) == 0.010  # no spread: the prediction
    save_cost_model(spread, tmp_path / "c.json")
    assert load_cost_model(tmp_path / "c.json").spread == spread.spread
