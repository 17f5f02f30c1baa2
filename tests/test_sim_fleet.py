"""The simulated fleet (tokenloom/sim/fleet.py): many simulated engines behind a routing.py policy, on one
virtual timeline. No model, no Ray: each run takes well under a second."""

from __future__ import annotations

import json

import pytest
from conftest import assert_engine_clean

from tokenloom.bench.workload import WorkloadRequest, make_workload, shared_prefix_workload
from tokenloom.config import EngineConfig
from tokenloom.engine.cost_model import LinearCostModel
from tokenloom.fleet.routing import POLICIES, make_policy
from tokenloom.sim.fleet import Disaggregation, FleetSim, build_replicas, kv_bytes_per_token, simulate_fleet
from tokenloom.sim.fleet_report import check_against_real, compare_with_real
from tokenloom.sim.simulator import simulate

# Prefill dominates (0.1 ms a token): a prefix-cache hit shows in TTFT.
COST = LinearCostModel(0.002, {"tokens": 1e-4})
# 100 blocks of 16 tokens per replica: room for about 5 of the 8 system prompts (16 blocks each) besides
# the running requests, so a replica sent all 8 keeps evicting them and one sent 4 keeps them.
TIGHT = EngineConfig(max_model_len=1024, num_kv_blocks=100)


def shared(n: int = 160, rate: float = 20.0, seed: int = 0, output_len: int = 8) -> list[WorkloadRequest]:
    return shared_prefix_workload(n, num_prefixes=8, prefix_len=256, suffix_len=16, output_len=output_len,
                                  request_rate=rate, seed=seed)


def run(workload, policy="round-robin", replicas=2, config=TIGHT, tokenizer=None, disagg=None, cost=COST, **kw):
    """A fleet run that also hands back the replicas, to check their engines afterwards."""
    roles = ["mixed"] * replicas if disagg is None else ["prefill"] * disagg.prefill + ["decode"] * disagg.decode
    reps = build_replicas(cost, roles, config, tokenizer=tokenizer)
    first = reps[0].engine
    kwargs = {"block_size": first.config.block_size, "blocks_per_replica": first.kv.num_blocks}
    pol = make_policy(policy, **kwargs) if policy == "prefix-aware" else make_policy(policy)
    sim = FleetSim(reps, pol, workload, disagg, kv_bytes_per_token(first.model_config, first.config), **kw)
    return sim.run(), reps


def test_shared_prefix_workload_is_seeded_and_shares_only_the_prefixes():
    wl = shared(64)
    assert wl == shared(64) and wl != shared(64, seed=1)
    assert len({r.request_id for r in wl}) == 64
    prefixes = [tuple(r.prompt_token_ids[:256]) for r in wl]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [8] * 8  # 8 users each, shuffled
    assert prefixes[:8] != prefixes[8:16]
    assert len({tuple(r.prompt_token_ids[256:]) for r in wl}) == 64  # every user's part its own
    assert all(len(r.prompt_token_ids) == 272 and r.max_tokens == 8 for r in wl)
    assert [r.arrival_time for r in wl] == sorted(r.arrival_time for r in wl)
    assert wl[-1].arrival_time == pytest.approx(64 / 20.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_aware_beats_round_robin_on_hit_rate_and_ttft(tokenizer, seed):
    wl = shared(seed=seed)
    rr = simulate_fleet(COST, wl, 2, "round-robin", TIGHT, tokenizer=tokenizer).summary()
    pa = simulate_fleet(COST, wl, 2, "prefix-aware", TIGHT, tokenizer=tokenizer).summary()
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.2, (pa["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert pa["mean_ttft_ms"] < 0.7 * rr["mean_ttft_ms"], (pa["mean_ttft_ms"], rr["mean_ttft_ms"])
    assert pa["load_spread"]["max_over_mean"] < 1.3  # and not by sending everything to one replica


def test_replicas_run_concurrently_in_virtual_time(tokenizer):
    """Two requests at t = 0, steps of 0.1 s, round-robin: one per replica, each as fast as alone."""
    cost = LinearCostModel(0.1, {})
    wl = [WorkloadRequest(f"r{i}", [1000 + i] * 8, 4) for i in range(2)]
    res, _ = run(wl, tokenizer=tokenizer, config=EngineConfig(max_model_len=64), cost=cost)
    alone = simulate(cost, wl[:1], EngineConfig(max_model_len=64), tokenizer=tokenizer)
    assert [r.requests for r in res.replicas] == [1, 1]
    assert [r.latency for r in res.requests] == pytest.approx([alone.requests[0].latency] * 2)
    assert res.replay.duration == pytest.approx(alone.duration)
    assert {rid for _, rid in res.completions} == {"r0", "r1"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", [
    EngineConfig(max_model_len=1024, num_kv_blocks=400),
    EngineConfig(max_model_len=1024, num_kv_blocks=40, max_num_batched_tokens=128),  # preemptions
    EngineConfig(max_model_len=1024, batching="dynamic", max_num_seqs=4, max_wait_ms=10.0),  # empty steps
    EngineConfig(max_model_len=1024, scheduling_policy="priority", num_kv_blocks=60),
], ids=["roomy", "preempting", "dynamic", "priority"])
def test_one_replica_is_exactly_the_single_engine_simulator(tokenizer, policy, config):
    wl = make_workload("mixed", 40, (16, 200), request_rate=30.0, seed=3, output_lens=(4, 40))
    alone = simulate(COST, wl, config, tokenizer=tokenizer)
    fleet = simulate_fleet(COST, wl, 1, policy, config, tokenizer=tokenizer)
    assert fleet.requests == alone.requests
    assert fleet.replay.num_steps == alone.num_steps
    assert fleet.replay.duration == alone.duration


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("disagg", [None, Disaggregation(1, 2), Disaggregation(2, 1)], ids=["mixed", "1:2", "2:1"])
def test_every_request_finishes_exactly_once(tokenizer, policy, disagg):
    wl = shared(200, rate=100.0, output_len=24)  # past what 3 replicas of 48 blocks take: queues, preemptions
    res, reps = run(wl, policy, 3, tokenizer=tokenizer, disagg=disagg,
                    config=EngineConfig(max_model_len=1024, num_kv_blocks=48))
    finished = sorted(rid for rid, _ in res.completions)
    assert finished == sorted(r.request_id for r in wl)  # none lost, none twice
    assert len(res.requests) == len(wl) and all(r.output_tokens == 24 for r in res.requests)
    assert sum(r.requests for r in res.replicas if r.role != "decode") == len(wl)
    for replica in reps:
        assert_engine_clean(replica.engine)
    if disagg is None:
        assert sum(r.engine.stats().num_preemptions for r in reps) > 0  # the load did push the engines


def test_disaggregated_decode_replicas_never_prefill_a_prompt(tokenizer):
    """With room in their KV pools (imported blocks are only evicted under pressure, and an import takes
    at most a quarter of the free blocks), decode replicas compute no prompt but its last block."""
    wl = shared(120, rate=30.0, output_len=16)  # prompts of 272 tokens: 17 full blocks
    res, _ = run(wl, "prefix-aware", tokenizer=tokenizer, disagg=Disaggregation(1, 2),
                 config=EngineConfig(max_model_len=1024, num_kv_blocks=1000))
    assert sorted(rid for rid, _ in res.completions) == sorted(r.request_id for r in wl)
    decode = [r for r in res.replicas if r.role == "decode"]
    prefill = [r for r in res.replicas if r.role == "prefill"]
    assert all(r.max_prefill_chunk <= 16 for r in decode)  # at most the prompt's last block
    assert max(r.max_prefill_chunk for r in prefill) > 16
    # Every prompt was found on its decode replica as a prefix-cache hit but for its last block (whose
    # last token must be computed to sample the first output token).
    assert sum(r.prefix_hits for r in decode) == sum((len(r.prompt_token_ids) - 1) // 16 * 16 for r in wl)
    assert {rid[0] for _, rid in res.completions} == {"d"}  # finished on a decode replica
    assert res.prefix_hit_rate == pytest.approx(
        sum(r.prefix_hits for r in prefill) / sum(r.prefix_queries for r in prefill))


def test_disaggregated_kv_transfer_costs_bytes_over_bandwidth(tokenizer):
    """One request of 100 prompt tokens: its 6 whole blocks (96 tokens) travel; a slower link delays every
    token, the first too (the decode replica streams them all), by exactly the extra transfer time."""
    wl = [WorkloadRequest("r0", list(range(1000, 1100)), 5)]
    cfg = EngineConfig(max_model_len=1024)
    fast, reps = run(wl, tokenizer=tokenizer, disagg=Disaggregation(1, 1, bandwidth=1e15), config=cfg)
    slow, _ = run(wl, tokenizer=tokenizer, disagg=Disaggregation(1, 1, bandwidth=1e9, latency_s=0.01), config=cfg)
    extra = 0.01 + 96 * kv_bytes_per_token(reps[0].engine.model_config, reps[0].engine.config) * (1e-9 - 1e-15)
    assert slow.requests[0].ttft - fast.requests[0].ttft == pytest.approx(extra)
    assert slow.requests[0].latency - fast.requests[0].latency == pytest.approx(extra)
    assert slow.requests[0].itl == pytest.approx(fast.requests[0].itl)
    assert slow.requests[0].output_tokens == 5
    decode = next(r for r in slow.replicas if r.role == "decode")
    assert decode.prefix_hits == 96 and decode.prefill_tokens == 4  # only the tail computed there


def test_goodput_counts_requests_within_both_slos(tokenizer):
    wl = shared(120, rate=40.0)
    res = simulate_fleet(COST, wl, 2, "round-robin", TIGHT, tokenizer=tokenizer, slo_ttft_ms=10, slo_tpot_ms=50)
    good = sum(1 for r in res.requests if r.ttft <= 0.010 and (r.latency - r.ttft) / (r.output_tokens - 1) <= 0.050)
    assert 0 < good < len(wl)
    assert res.summary()["goodput"] == pytest.approx(good / res.replay.duration)
    assert simulate_fleet(COST, wl, 2, "round-robin", TIGHT, tokenizer=tokenizer).summary()["goodput"] is None


def test_compare_with_real_flags_what_is_off(tokenizer, capsys):
    sim = {"prefix_hit_rate": 0.80, "mean_ttft_ms": 100.0}
    report = compare_with_real(0.75, 120.0, sim, ttft_stat="mean")
    assert report["prefix_hit_rate"]["within"] and not report["mean_ttft_ms"]["within"]
    assert report["mean_ttft_ms"]["relative_difference"] == pytest.approx(20 / 120)
    assert "OFF" in capsys.readouterr().out


def test_check_against_real_replays_the_real_runs_dataset(tokenizer, tmp_path, capsys):
    """A bench serve .jsonl (text prompts sharing system prompts): the twin sends the very prompts, as
    the server tokenizes them, at the client's arrival times; its own numbers come back as a match."""
    from tokenloom.bench.arrivals import arrival_times
    from tokenloom.sim.fleet_report import dataset_workload

    lines = [{"prompt": f"You are the assistant of shop {s}. " + "Be brief and polite. " * 20 + f"Customer {u}: hi",
              "max_tokens": 8} for u in range(6) for s in range(4)]
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    wl = dataset_workload(str(path), 24, 4.0, tokenizer=tokenizer)
    assert [r.prompt_token_ids for r in wl] == [tokenizer.encode(x["prompt"]) for x in lines]
    assert [r.arrival_time for r in wl] == arrival_times(24, 4.0, 1.0, 0)
    assert all(r.max_tokens == 8 for r in wl)
    twin = simulate_fleet(COST, wl, 2, "prefix-aware", TIGHT, tokenizer=tokenizer).summary()
    assert twin["prefix_hit_rate"] > 0.5  # the system prompts are shared
    report = check_against_real(twin["prefix_hit_rate"], twin["median_ttft_ms"] * 1.1, COST, wl, 2,
                                "prefix-aware", TIGHT)
    assert report["prefix_hit_rate"]["relative_difference"] == 0.0
    assert report["median_ttft_ms"]["within"]
    assert report["median_ttft_ms"]["relative_difference"] == pytest.approx(0.1 / 1.1)
    assert "simulated 2 replicas, prefix-aware, 24 requests" in capsys.readouterr().out


def cli(argv, capsys):
    from tokenloom.cli import main

    code = main(argv)
    return code, capsys.readouterr()


BASE = ["simulate-fleet", "--cost-model", "llama-3-8b@h100", "--num-prompts", "24", "--prefix-len", "64",
        "--suffix-len", "8", "--output-len", "4", "--request-rate", "50"]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--replicas", "0"], "--replicas"),
    (["--disaggregate", "4"], "--disaggregate"),
    (["--disaggregate", "0:3"], "--disaggregate"),
    (["--shared-prefixes", "-1"], "--shared-prefixes"),
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
    (["--cost-model", "no-such-file.json"], "--cost-model"),
    (["--cost-model", "llama-3-8b@tpu"], "--cost-model"),
    (["--output-len-dist", "zipf:3"], "--output-len-dist"),
])
def test_bad_flag_values_are_one_line_naming_the_flag(capsys, argv, flag):
    code, out = cli(BASE + argv, capsys)
    assert code == 2
    assert out.err.startswith("error: ") and flag in out.err and "Traceback" not in out.err
    assert out.err.count(flag.lstrip("-").split("-")[0]) == 1  # named once, not "--x: x: ..."


def test_bad_routing_policy_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        cli([*BASE, "--routing-policy", "random"], capsys)
    assert exc.value.code == 2
    assert "--routing-policy" in capsys.readouterr().err


def test_cli_writes_json_markdown_and_plots(tmp_path, capsys):
    code, out = cli([*BASE, "--replicas", "3", "--request-rate", "20", "40", "--slo-ttft-ms", "100",
                     "--slo-tpot-ms", "50", "--out", str(tmp_path)], capsys)
    assert code == 0, out.err
    report = json.loads((tmp_path / "fleet_sim.json").read_text())
    assert report["replicas"] == 3 and report["engine"]["dtype"] == "bfloat16"
    runs = report["runs"]
    assert [(r["policy"], r["request_rate"]) for r in runs] == [(p, rate) for p in POLICIES for rate in (20, 40)]
    assert all(r["completed"] == 24 and r["goodput"] is not None and len(r["ttft_quantiles_ms"]) == 101 for r in runs)
    for name in ("fleet_sim.md", "fleet_sim_goodput.png", "fleet_sim_hit_rate.png", "fleet_sim_ttft_cdf.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "prefix-aware" in out.out


def test_a_request_arriving_as_a_step_ends_joins_the_next_step(tokenizer):
    """Steps of exactly 0.1 s; r1 arrives at 0.1, as r0's first step ends: it is in the step from 0.1
    (TTFT one step), as in the single-engine replay. Starting steps before arrivals would leave it a step."""
    cost = LinearCostModel(0.1, {})
    wl = [WorkloadRequest("r0", [1000] * 8, 3), WorkloadRequest("r1", [2000] * 8, 3, arrival_time=0.1)]
    cfg = EngineConfig(max_model_len=64)
    fleet, _ = run(wl, "least-loaded", 1, cfg, tokenizer, cost=cost)
    assert fleet.requests[1].ttft == pytest.approx(0.1)
    assert fleet.requests == simulate(cost, wl, cfg, tokenizer=tokenizer).requests


def test_warmup_requests_run_but_are_not_measured(tokenizer):
    wl = shared(160)  # 8 s of arrivals
    whole = simulate_fleet(COST, wl, 2, "prefix-aware", TIGHT, tokenizer=tokenizer)
    warm = simulate_fleet(COST, wl, 2, "prefix-aware", TIGHT, tokenizer=tokenizer, warmup_s=2.0)
    late = [r for r in wl if r.arrival_time >= 2.0]
    assert len(warm.requests) == len(late) and len(warm.completions) == len(wl)
    by_id = dict(zip((r.request_id for r in wl), whole.requests, strict=True))
    assert [r.ttft for r in warm.requests] == [by_id[r.request_id].ttft for r in late]  # the same run
    assert warm.prefix_hit_rate > whole.prefix_hit_rate  # cold misses are in the warm-up
    assert 0 < warm.summary()["busy_fraction"]["max"] <= 1  # busy over the whole run, warm-up included
    assert whole.prefix_hit_rate == pytest.approx(
        sum(r.prefix_hits for r in whole.replicas) / sum(r.prefix_queries for r in whole.replicas))
    with pytest.raises(ValueError, match="warmup_s"):
        simulate_fleet(COST, wl, 2, "prefix-aware", TIGHT, tokenizer=tokenizer, warmup_s=100.0)


def test_the_simulator_never_loads_ray():
    """The simulated fleet uses routing.py alone: importing and running it must not pull Ray in (Ray
    is an optional dependency; `tokenloom/fleet`'s other modules import it)."""
    import subprocess
    import sys

    code = ("import sys; import tokenloom.sim.fleet, tokenloom.sim.fleet_cli, tokenloom.sim.fleet_report; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    from pathlib import Path

    for path in (Path(__file__).parent.parent / "tokenloom" / "sim").glob("*.py"):
        text = path.read_text()
        assert "import ray" not in text and "from ray" not in text, path


def test_a_run_leaves_nothing_frozen(tokenizer):
    """Each engine gc.freeze()s what exists when built, the run's earlier replicas too, and the KV pools'
    block lists are reference cycles: unless the run undoes it, every run's engines stay in memory for
    good (~3 MB a replica; GBs over the benchmark's sweep)."""
    import gc

    simulate_fleet(COST, shared(20), 3, "prefix-aware", TIGHT, tokenizer=tokenizer)
    assert gc.get_freeze_count() == 0
