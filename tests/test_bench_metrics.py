"""Hand-computed checks of the `vllm bench serve` metric definitions and the arrival schedule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tokenloom.bench.arrivals import arrival_times
from tokenloom.bench.serving_metrics import RequestResult, compute_metrics, peak_concurrency, percentile_key


def ok(start: float, ttft: float, itl: list[float], out: int, prompt: int) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=prompt,
        output_tokens=out,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
        usage_reported=True,
    )


# r1: TPOT (0.5-0.1)/4 = 0.1 | r2: TPOT (0.55-0.15)/2 = 0.2 | r3: 1 token, no TPOT | r4: TPOT 0.1/1
R1 = ok(0.0, 0.10, [0.1, 0.1, 0.1, 0.1], out=5, prompt=10)
R2 = ok(0.5, 0.15, [0.2, 0.2], out=3, prompt=20)
R3 = ok(1.0, 0.05, [], out=1, prompt=5)
R4 = ok(0.2, 0.40, [0.1], out=2, prompt=8)
FAILED = RequestResult(success=False, error="boom", prompt_len=100, output_tokens=50, ttft=10.0, latency=10.0,
                       itl=[5.0], start_time=0.3)  # fmt: skip
RESULTS = [R1, R2, R3, R4, FAILED]


def test_counts_and_throughputs_ignore_failures():
    m = compute_metrics(RESULTS, duration=2.0)
    assert m.completed == 4 and m.failed == 1
    assert m.total_input_tokens == 10 + 20 + 5 + 8
    assert m.total_output_tokens == 5 + 3 + 1 + 2
    assert m.output_lens == [5, 3, 1, 2, 0]
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(5.5)
    assert m.total_token_throughput == pytest.approx((43 + 11) / 2.0)
    assert m.request_goodput is None  # no SLO given


def test_ttft_stats_and_linear_percentiles():
    d = compute_metrics(RESULTS, duration=2.0).to_dict()
    # TTFT ms = [100, 150, 50, 400] -> sorted [50, 100, 150, 400]; failed request's 10 s not included
    assert d["mean_ttft_ms"] == pytest.approx(175.0)
    assert d["median_ttft_ms"] == pytest.approx(125.0)
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt((75**2 + 25**2 + 125**2 + 225**2) / 4))
    assert d["p50_ttft_ms"] == pytest.approx(125.0)
    assert d["p90_ttft_ms"] == pytest.approx(150 + 0.7 * 250)  # rank 0.9 * 3 = 2.7
    assert d["p99_ttft_ms"] == pytest.approx(150 + 0.97 * 250)


def test_tpot_excludes_first_token_and_single_token_requests():
    d = compute_metrics(RESULTS, duration=2.0).to_dict()
    # TPOT ms = [100, 200, 100] (R3 with one token is left out)
    assert d["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert d["median_tpot_ms"] == pytest.approx(100.0)
    assert d["p90_tpot_ms"] == pytest.approx(100 + 0.8 * 100)  # rank 0.9 * 2 = 1.8


def test_itl_pools_every_gap_and_e2el():
    d = compute_metrics(RESULTS, duration=2.0).to_dict()
    # gaps ms = [100]*4 + [200, 200] + [100]; failed request's 5 s gap not included
    assert d["mean_itl_ms"] == pytest.approx(900 / 7)
    assert d["median_itl_ms"] == pytest.approx(100.0)
    assert d["p90_itl_ms"] == pytest.approx(200.0)
    assert d["mean_e2el_ms"] == pytest.approx((500 + 550 + 50 + 500) / 4)
    assert d["median_e2el_ms"] == pytest.approx(500.0)


def test_goodput_with_ttft_and_tpot_slos():
    # R1 good; R2 fails TPOT (200 > 150); R3 good (1 token -> TPOT 0); R4 fails TTFT (400 > 200)
    m = compute_metrics(RESULTS, duration=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert m.request_goodput == pytest.approx(2 / 2.0)
    m = compute_metrics(RESULTS, duration=2.0, slo_ttft_ms=200)
    assert m.request_goodput == pytest.approx(3 / 2.0)
    m = compute_metrics(RESULTS, duration=2.0, slo_e2el_ms=500)  # <= is good: R1, R3, R4
    assert m.request_goodput == pytest.approx(3 / 2.0)


def test_single_token_request_good_even_with_tight_tpot_slo():
    m = compute_metrics([R3], duration=1.0, slo_tpot_ms=0.001)
    assert m.request_goodput == pytest.approx(1.0)
    assert m["mean_tpot_ms"] == 0.0  # no TPOT sample at all -> 0, as vLLM's np.mean(x or 0)


def test_peak_concurrency_and_peak_tokens_per_s():
    m = compute_metrics(RESULTS, duration=2.0)
    # intervals [0,.5) [.5,1.05) [1,1.05) [.2,.7): never more than two at once (failed one ignored)
    assert m.max_concurrent_requests == 2
    # messages in second 0: R1 5, R2 2 (0.65, 0.85), R4 2 (0.6, 0.7); second 1: R2 1.05, R3 1.05
    assert m.max_output_tokens_per_s == 9.0
    assert peak_concurrency([(0, 1), (1, 2)]) == 1  # half-open: a departure frees the slot first
    assert peak_concurrency([(0, 2), (0.5, 1.5), (1, 3), (2, 4)]) == 3


def test_all_failed_gives_zeros_not_nan():
    m = compute_metrics([FAILED], duration=1.0, slo_ttft_ms=100)
    d = m.to_dict()
    assert d["completed"] == 0 and d["failed"] == 1 and d["request_goodput"] == 0.0
    assert all(d[k] == 0.0 for k in d if k.endswith("_ms"))


def test_result_keys_follow_vllm_names():
    d = compute_metrics(RESULTS, duration=2.0, percentiles=(50, 90, 99, 99.9)).to_dict()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in d
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms"
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "max_output_tokens_per_s",
                "max_concurrent_requests"):  # fmt: skip
        assert key in d


def test_gamma_arrivals_rescaled_so_last_lands_at_n_over_rate():
    for burstiness in (0.5, 1.0, 4.0):
        t = arrival_times(200, rate=8.0, burstiness=burstiness, seed=3)
        assert len(t) == 200
        assert t[-1] == pytest.approx(200 / 8.0)
        assert all(b >= a for a, b in itertools.pairwise(t)) and t[0] > 0
    assert arrival_times(50, 2.0, 1.0, seed=7) == arrival_times(50, 2.0, 1.0, seed=7)
    assert arrival_times(50, 2.0, 1.0, seed=7) != arrival_times(50, 2.0, 1.0, seed=8)
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_gamma_shape_sets_burstiness():
    def cv(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_times(4000, 10.0, burstiness, seed=1)])
        return float(np.std(gaps) / np.mean(gaps))

    assert cv(1.0) == pytest.approx(1.0, abs=0.1)  # Poisson: exponential gaps, CV 1
    assert cv(16.0) == pytest.approx(0.25, abs=0.05)  # gamma CV = 1 / sqrt(shape)
    assert cv(0.25) == pytest.approx(2.0, abs=0.3)


def test_bad_arrival_parameters():
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0.0)
    with pytest.raises(ValueError):
        compute_metrics(RESULTS, duration=0.0)
