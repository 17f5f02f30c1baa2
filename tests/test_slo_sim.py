"""The simulator runs the engine's own SLO and fairness policies on its virtual clock and reports attainment
and goodput as the server counts them."""

from __future__ import annotations

import dataclasses
import statistics

from tokenloom import EngineConfig
from tokenloom.bench.workload import make_workload
from tokenloom.sim.cost_model import preset
from tokenloom.sim.simulator import simulate
from tokenloom.slo import SLO

COST = preset("llama-3-8b@h100")


def overload(n: int = 120):
    slo = SLO(ttft_ms=200, tpot_ms=30)
    return [dataclasses.replace(r, slo=slo) for r in make_workload("mixed", n, request_rate=40, seed=3)]


def run(workload, **config):
    return simulate(COST, workload, EngineConfig(max_num_seqs=16, dtype="bfloat16", **config))


def test_simulated_attainment_and_goodput_under_overload():
    fcfs = run(overload()).summary()
    slo = run(overload(), scheduling_policy="slo").summary()
    shed = run(overload(), scheduling_policy="slo", slo_shed=True).summary()
    for s in (fcfs, slo, shed):
        assert {"slo_attained_ttft", "slo_attained_tpot", "slo_attained_both", "goodput"} <= set(s)
        assert 0 <= s["slo_attained_both"] <= min(s["slo_attained_ttft"], s["slo_attained_tpot"])
    assert slo["completed"] == fcfs["completed"] == 120  # the slo policy drops nobody
    assert slo["goodput"] > fcfs["goodput"]
    assert shed["slo_shed"] > 0 and shed["completed"] == 120 - shed["slo_shed"]
    assert shed["goodput"] > slo["goodput"]


def test_simulated_vtc_shields_a_light_tenant_from_a_heavy_one():
    heavy = [dataclasses.replace(r, tenant="heavy") for r in make_workload("mixed", 100, request_rate=60, seed=1)]
    light = [dataclasses.replace(r, request_id=f"light{i}", tenant="light", arrival_time=0.1 + 0.2 * i)
             for i, r in enumerate(make_workload("uniform", 10, output_len=16, seed=2))]

    def light_ttft(**config) -> float:
        result = run(heavy + light, **config)
        ttfts = [r.ttft for r, w in zip(result.requests, heavy + light, strict=True) if w.tenant == "light"]
        return statistics.median(ttfts)

    assert light_ttft(fairness="vtc") < 0.5 * light_ttft()
