"""Engine-level behaviour on the tiny model: batch invariance, prefix caching, preemption by
recompute and swap, scheduling policies with aging, and the static / dynamic / continuous modes."""

from __future__ import annotations

import random
import time

import pytest

from tokenloom import SamplingParams


def prompt(i: int, length: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(50, 40000) for _ in range(length)]


def run_all(engine, requests, arrive_every: int = 0) -> dict[str, list[int]]:
    """Add (id, prompt, params) requests, one every `arrive_every` steps (0 = all at once); run to the end."""
    pending = list(requests)
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (arrive_every == 0 or step % arrive_every == 0):
            rid, p, sp = pending.pop(0)
            engine.add_request(rid, p, sp)
            if arrive_every:
                break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.check_kv_invariants()
        step += 1
    return done


def mixed_requests(count=16, max_tokens=(4, 24)):
    rng = random.Random(1)
    return [
        (f"r{i}", prompt(i, rng.randint(3, 60)),
         SamplingParams(temperature=0, max_tokens=rng.randint(*max_tokens), ignore_eos=True))
        for i in range(count)
    ]


def test_greedy_is_batch_invariant(make_engine):
    reqs = mixed_requests()
    alone = {}
    solo = make_engine(max_num_seqs=1, enable_prefix_caching=False)
    for rid, p, sp in reqs:
        alone.update(run_all(solo, [(rid, p, sp)]))
    batched = run_all(make_engine(max_num_batched_tokens=32), reqs, arrive_every=2)
    assert batched == alone


def test_prefix_cache_computes_only_new_tokens_and_matches_uncached(make_engine):
    shared = prompt(99, 256)
    a, b = shared + prompt(1, 10), shared + prompt(2, 7)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = make_engine(block_size=16)
    out_a = run_all(cached, [("a", a, sp)])
    cached.add_request("b", b, sp)
    seq_b = cached.requests["b"].seqs[0]
    cached.step()
    assert seq_b.num_cached_prompt_tokens == 256
    computed_b = cached.last_step.num_batched_tokens
    assert computed_b == len(b) - 256  # only its own 7 tokens were computed
    out_b = run_all(cached, [])
    assert cached.stats().prefix_hit_rate > 0
    plain = make_engine(block_size=16, enable_prefix_caching=False)
    assert run_all(plain, [("a", a, sp), ("b", b, sp)]) == {**out_a, "b": out_b["b"]}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_completes_everything_with_identical_output(make_engine, mode):
    reqs = mixed_requests(16, max_tokens=(20, 40))
    reference = run_all(make_engine(num_kv_blocks=512), reqs)
    # 4 sequences of ~100 tokens fit in 28 blocks of 16: the rest must wait or be preempted.
    tight = make_engine(num_kv_blocks=28, block_size=16, max_num_seqs=16, preemption_mode=mode, swap_space=0.01)
    assert run_all(tight, reqs) == reference
    assert tight.scheduler.num_preemptions > 0
    if mode == "swap":
        assert tight.scheduler.num_swaps > 0
    assert tight.kv.all_free()


def test_request_that_can_never_fit_is_rejected(make_engine):
    engine = make_engine(num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("big", prompt(0, 50), SamplingParams(max_tokens=30))


def admission_order(engine, requests) -> list[str]:
    """Order in which requests are first scheduled, with one sequence running at a time."""
    for rid, p, sp in requests:
        engine.add_request(rid, p, sp)
    order = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq_id in engine.last_step.seq_ids:
            rid = seq_id.split("#")[0]
            if rid not in order:
                order.append(rid)
    return order


def test_fcfs_sjf_priority_orders(make_engine):
    def reqs():
        return [
            ("long", prompt(1, 5), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=1)),
            ("short", prompt(2, 5), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=2)),
            ("mid", prompt(3, 5), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, priority=0)),
        ]

    assert admission_order(make_engine(max_num_seqs=1), reqs()) == ["long", "short", "mid"]
    assert admission_order(make_engine(max_num_seqs=1, scheduling_policy="sjf"), reqs()) == ["short", "mid", "long"]
    assert admission_order(make_engine(max_num_seqs=1, scheduling_policy="priority"), reqs()) == ["mid", "long", "short"]


def test_priority_preempts_the_lowest_priority_victim(make_engine):
    engine = make_engine(num_kv_blocks=6, block_size=4, scheduling_policy="priority", max_num_seqs=4)
    sp = lambda prio: SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, priority=prio)
    engine.add_request("low", prompt(1, 7), sp(5))
    engine.add_request("high", prompt(2, 7), sp(0))
    preempted = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step.num_preempted:
            preempted += [s.request_id for s in engine.scheduler.running + engine.scheduler.waiting
                          if s.num_preemptions and s.request_id not in preempted]
    assert preempted and preempted[0] == "low"


def test_aging_lets_low_priority_finish_under_a_stream_of_high_priority(make_engine):
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority", priority_aging_s=0.05)
    low = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=10)
    high = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=0)
    engine.add_request("low", prompt(0, 4), low)
    finished_low = False
    for i in range(400):  # a new high-priority request arrives at every step, forever
        engine.add_request(f"high{i}", prompt(i + 1, 4), high)
        if any(o.request_id == "low" and o.finished for o in engine.step()):
            finished_low = True
            break
        time.sleep(0.002)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert finished_low


def test_static_batching_admits_only_when_the_batch_is_done(make_engine):
    engine = make_engine(batching="static", max_num_seqs=2)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.add_request("a", prompt(1, 4), sp(2))
    engine.add_request("b", prompt(2, 4), sp(8))
    engine.add_request("c", prompt(3, 4), sp(2))
    steps_with_c = []
    step = 0
    b_done = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if any(o.request_id == "b" and o.finished for o in outs):
            b_done = step
        if "c#0" in engine.last_step.seq_ids:
            steps_with_c.append(step)
        step += 1
    assert steps_with_c[0] == b_done + 1  # c waited for the longest member of the first batch


def test_static_batch_pads_finished_slots_without_changing_outputs(make_engine):
    reqs = [(f"r{i}", prompt(i, 5), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, n in enumerate([2, 9, 4, 9])]
    continuous = run_all(make_engine(), reqs)
    static = make_engine(batching="static", max_num_seqs=4)
    paddings = []
    static.step_listeners.append(lambda stats, outputs: paddings.append(stats.num_padding))
    assert run_all(static, reqs) == continuous
    assert max(paddings) == 2  # r0 and r2 finished early: their slots are computed as padding


def test_dynamic_batching_waits_for_a_full_batch_or_the_window(make_engine):
    engine = make_engine(batching="dynamic", max_num_seqs=3, max_wait_ms=80)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt(1, 4), sp)
    engine.step()
    assert engine.last_step.num_seqs == 0  # alone and within the window: wait
    engine.add_request("b", prompt(2, 4), sp)
    engine.add_request("c", prompt(3, 4), sp)
    engine.step()
    assert sorted(engine.last_step.seq_ids) == ["a#0", "b#0", "c#0"]  # full batch: go
    run_all(engine, [])
    engine.add_request("d", prompt(4, 4), sp)
    engine.step()
    assert engine.last_step.num_seqs == 0
    time.sleep(0.1)
    engine.step()
    assert engine.last_step.seq_ids == ["d#0"]  # the window expired: go with what is there
    run_all(engine, [])


def test_config_validation_names_the_field(make_engine):
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_engine(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="batching"):
        make_engine(batching="sometimes")
    with pytest.raises(ValueError, match="swap_space"):
        make_engine(preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64)


def test_prefix_cache_hits_blocks_of_a_prompt_still_in_chunked_prefill(make_engine):
    shared = prompt(7, 100)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine = make_engine(block_size=8, max_num_batched_tokens=24, long_prefill_token_threshold=16)
    engine.add_request("a", shared + [11], sp)
    engine.step()
    engine.step()  # "a" has 32 of 101 tokens computed (two chunks of 16)
    engine.add_request("b", shared + [12], sp)
    engine.step()  # "a" computes tokens 32..47 while "b" is admitted in the same step
    seq_b = engine.requests["b"].seqs[0]
    # "b" reuses the blocks "a" computed before and the ones it is computing in this very step.
    assert seq_b.num_cached_prompt_tokens == 48
    outputs = run_all(engine, [])
    plain = run_all(make_engine(enable_prefix_caching=False), [("a", shared + [11], sp), ("b", shared + [12], sp)])
    assert outputs == plain
