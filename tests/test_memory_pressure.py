"""Memory pressure: a KV budget far below demand under Poisson arrivals. Both preemption modes must
complete every request with its full output, free every block, and report the latency p99; a request
that can never fit is refused up front with a clear ValueError (a 400 from the server)."""

from __future__ import annotations

import random
import time

import pytest

from tokenloom import SamplingParams

NUM_REQUESTS = 24
RATE = 100.0  # requests per second (Poisson), in virtual time: each engine step advances it by STEP_S
STEP_S = 0.005  # so the pressure does not depend on how fast (or how shared) the machine is


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_poisson_arrivals_far_above_kv_budget(make_engine, mode):
    # 8 blocks of 16 = 128 tokens of KV, against ~24 x 43 = 1000 tokens of demand arriving in ~50 steps.
    engine = make_engine(num_kv_blocks=8, block_size=16, preemption_mode=mode, swap_space=0.001, max_num_seqs=8,
                         max_num_batched_tokens=128, enable_prefix_caching=True)
    rng = random.Random(1234)
    t, arrivals = 0.0, []
    for i in range(NUM_REQUESTS):
        t += rng.expovariate(RATE)
        prompt = [rng.randrange(1, 49000) for _ in range(rng.randint(16, 48))]
        arrivals.append((t, f"r{i}", prompt, rng.randint(6, 16)))
    expected = {rid: mt for _, rid, _, mt in arrivals}
    done: dict[str, float] = {}  # wall-clock latency
    done_steps: dict[str, int] = {}  # latency in engine steps
    arrival_at: dict[str, tuple[float, int]] = {}
    start = time.monotonic()
    pending = list(arrivals)
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step * STEP_S:
            _, rid, prompt, max_tokens = pending.pop(0)
            arrival_at[rid] = (time.monotonic(), step)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7, seed=1),
                               arrival_time=arrival_at[rid][0])
        step += 1
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            if out.finished:
                assert out.error is None and out.request_id not in done
                assert len(out.outputs[0].token_ids) == expected[out.request_id]
                done[out.request_id] = time.monotonic() - arrival_at[out.request_id][0]
                done_steps[out.request_id] = step - arrival_at[out.request_id][1]
        engine.check_kv_invariants()
    assert sorted(done) == sorted(expected), "every request completes"
    assert engine.kv.all_free()
    preemptions, swaps = engine.scheduler.num_preemptions, engine.scheduler.num_swaps
    assert preemptions > 0
    if mode == "swap":
        assert swaps > 0
    lat, lat_steps = list(done.values()), list(done_steps.values())
    print(f"\nmemory pressure [{mode}]: {len(done)}/{NUM_REQUESTS} completed, preemptions {preemptions}, "
          f"swaps {swaps}, latency p50 {percentile(lat, 50):.3f}s p99 {percentile(lat, 99):.3f}s "
          f"(p99 {percentile(lat_steps, 99)} steps), {step} steps, wall {time.monotonic() - start:.2f}s")


def test_request_that_can_never_fit_is_refused(make_engine):
    engine = make_engine(num_kv_blocks=4, block_size=16)  # 64 tokens of KV
    with pytest.raises(ValueError, match=r"max_tokens: .*needs 5 KV blocks but the cache has 4"):
        engine.add_request("big", list(range(1, 51)), SamplingParams(max_tokens=30))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", list(range(1, 41)), SamplingParams(max_tokens=20, ignore_eos=True))  # exactly 4 blocks
    while engine.has_unfinished_requests():
        engine.step()


def test_decode_steps_trim_the_heap_once_a_second(make_engine, monkeypatch):
    """Freed pages go back to the OS after long prompt steps and, for decode-only stretches, once a
    TRIM_EVERY_S: a streaming server otherwise crept up between prompts."""
    from tokenloom.engine import heap_policy

    trims = []
    monkeypatch.setattr(heap_policy, "trim_heap", lambda: trims.append(time.monotonic()))
    engine = make_engine()
    engine.add_request("r", "Hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prompt
    trims.clear()
    engine.heap.last_trim_at = time.monotonic()  # as if a trim just ran
    engine.step()
    assert trims == [], "a decode step trimmed within a second of the last trim"
    engine.heap.last_trim_at = time.monotonic() - heap_policy.TRIM_EVERY_S
    engine.step()
    assert len(trims) == 1, "a decode step a second after the last trim did not trim"
    while engine.has_unfinished_requests():
        engine.step()
