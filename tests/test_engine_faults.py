"""Fault isolation in the engine: an error while handling one request fails that request alone; a
failing batched forward fails its step's requests and the engine goes on; what the engine cannot
survive raises EngineFatalError. Faults come from `tokenloom.faults` (off, and free, unless armed).
"""

from __future__ import annotations

import pytest

from tokenloom import SamplingParams, faults
from tokenloom.engine.llm_engine import MAX_CONSECUTIVE_FORWARD_FAILURES, EngineFatalError


@pytest.fixture(autouse=True)
def _clear_faults():
    faults.clear()
    yield
    faults.clear()


def run(engine, max_steps: int = 1000) -> dict:
    """Step until idle; {request_id: [finished outputs]} (each request must finish exactly once)."""
    finished: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)
        engine.check_kv_invariants()
    assert not engine.has_unfinished_requests()
    assert all(len(v) == 1 for v in finished.values()), "a request finished twice"
    return {k: v[0] for k, v in finished.items()}


def add_many(engine, ids, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("ignore_eos", True)
    for i, rid in enumerate(ids):
        engine.add_request(rid, f"Request number {i} says hello", SamplingParams(**kw))


@pytest.mark.parametrize("site", ["sampler", "detok", "logprobs"])
def test_per_request_fault_fails_that_request_alone(make_engine, site):
    engine = make_engine(num_kv_blocks=64)
    faults.inject(site, "bad")
    add_many(engine, ["good-1", "bad", "good-2", "good-3"], logprobs=2, temperature=0.8, seed=1)
    outs = run(engine)
    assert outs["bad"].error and "injected fault" in outs["bad"].error
    assert [c.finish_reason for c in outs["bad"].outputs] == ["error"]
    for rid in ("good-1", "good-2", "good-3"):
        assert outs[rid].error is None and outs[rid].outputs[0].finish_reason == "length"
        assert len(outs[rid].outputs[0].token_ids) == 8
    assert engine.fault_stats.requests_failed_alone == 1
    assert engine.fault_stats.requests_failed_collateral == 0
    assert engine.kv.all_free()


def test_sampler_fault_does_not_change_the_other_rows(make_engine):
    """The per-row retry samples the innocent rows exactly as the batch would have (greedy and seeded)."""
    engine = make_engine(num_kv_blocks=64)
    add_many(engine, ["req-a", "req-b", "req-c"], temperature=0.9, seed=7)
    clean = {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}
    faults.inject("sampler", "req-b")
    add_many(engine, ["req-a", "req-b", "req-c"], temperature=0.9, seed=7)
    faulty = run(engine)
    assert faulty["req-b"].error
    assert faulty["req-a"].outputs[0].token_ids == clean["req-a"]
    assert faulty["req-c"].outputs[0].token_ids == clean["req-c"]


def test_fault_by_prompt_marker_and_n_gt_1(make_engine):
    """A rule can match the prompt text (what an HTTP client controls); n > 1 fails the whole request."""
    engine = make_engine(num_kv_blocks=64)
    faults.inject("detok", "BOOM")
    engine.add_request("x", "please go BOOM now", SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    engine.add_request("y", [1, 2, 3, 4], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    outs = run(engine)
    assert outs["x"].error and all(c.finish_reason == "error" for c in outs["x"].outputs)
    assert outs["y"].error is None and all(len(c.token_ids) == 6 for c in outs["y"].outputs)


def test_forward_failure_fails_its_step_and_engine_goes_on(make_engine):
    engine = make_engine(num_kv_blocks=64, enable_prefix_caching=True)
    faults.inject("forward", "3")
    add_many(engine, ["a", "b", "c"])
    outs = run(engine)
    assert all(out.error and "forward" in out.error for out in outs.values())
    assert engine.fault_stats.requests_failed_collateral == 3 and engine.fault_stats.forward_failures == 1
    # The engine serves the next requests normally, the same prompts too (no stale prefix-cache KV).
    add_many(engine, ["a2", "b2", "c2"])
    outs = run(engine)
    assert all(out.error is None and len(out.outputs[0].token_ids) == 8 for out in outs.values())


def test_forward_fault_aimed_at_a_request_fails_its_step_once(make_engine):
    engine = make_engine(num_kv_blocks=64)
    rule = faults.inject("forward", "req-x")
    add_many(engine, ["req-a", "req-x", "req-b"])
    outs = run(engine)
    assert rule.fired == 1 and all(out.error for out in outs.values())
    assert engine.fault_stats.requests_failed_collateral == 3


def test_forward_failure_only_hits_that_steps_requests(make_engine):
    """A request still waiting (not in the failing step) is not collateral."""
    engine = make_engine(num_kv_blocks=64, max_num_seqs=2)
    faults.inject("forward", "2")
    add_many(engine, ["a", "b", "c", "d"])
    outs = run(engine)
    failed = sorted(rid for rid, out in outs.items() if out.error)
    assert failed == ["a", "b"]
    assert all(len(outs[r].outputs[0].token_ids) == 8 for r in ("c", "d"))


def test_repeated_forward_failures_are_fatal(make_engine):
    engine = make_engine(num_kv_blocks=64)
    faults.inject("forward", "*")
    with pytest.raises(EngineFatalError, match="in a row"):
        for i in range(MAX_CONSECUTIVE_FORWARD_FAILURES):
            engine.add_request(f"r{i}", "hello there", SamplingParams(max_tokens=4))
            engine.step()
    assert engine.fault_stats.consecutive_forward_failures == MAX_CONSECUTIVE_FORWARD_FAILURES
    assert engine.kv.all_free()  # the step's requests were failed (and freed) before the fatal error
    for rid in list(engine.requests):
        engine.abort_request(rid)


def test_scheduler_error_is_fatal(make_engine):
    engine = make_engine(num_kv_blocks=64)
    faults.inject("scheduler", "2")
    engine.add_request("r", "hello there", SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(EngineFatalError, match="scheduler"):
        engine.step()
    engine.abort_request("r")


def test_faults_off_costs_nothing_and_env_spec_parses():
    assert not faults.ACTIVE
    rules = faults.configure("sampler:req-A, detok:req-B,forward:3+")
    assert [(r.site, r.target) for r in rules] == [("sampler", "req-A"), ("detok", "req-B"), ("forward", "3+")]
    assert rules[2].matches_step(3) and rules[2].matches_step(9) and not rules[2].matches_step(2)
    assert not faults.inject("forward", "marker").matches_step(1)
    assert faults.ACTIVE
    with pytest.raises(ValueError):
        faults.configure("nosuchsite:1")
