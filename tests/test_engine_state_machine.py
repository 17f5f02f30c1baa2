"""A hypothesis state machine over the engine on the tiny model: add / step / abort / inject a fault in
random order, with a KV cache small enough that preemption happens all the time, in both preemption
modes with prefix caching on. After every rule: no leaked or double-freed block (the KV invariants)
and no request has ended more than once; at the end, once drained, every request ended exactly once
(a finished output, or its abort) and every block is free.
"""

from __future__ import annotations

import time

import hypothesis.strategies as st
from conftest import TINY
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenloom import EngineConfig, SamplingParams, faults
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.loader import bundled_model_path, random_model
from tokenloom.model.tokenizer import load_tokenizer

_MODEL = None
_TOKENIZER = None
STATS = {"examples": 0, "steps": 0, "preemptions": 0, "faults": 0, "finished": 0, "aborted": 0, "failed_alone": 0,
         "failed_collateral": 0, "forward_failures": 0, "blocks_leaked": 0}
BASE = list(range(100, 164))  # a shared prefix: four full blocks of 16


def _model():
    global _MODEL, _TOKENIZER
    if _MODEL is None:
        _MODEL, _TOKENIZER = random_model(TINY, seed=0), load_tokenizer(bundled_model_path())
    return _MODEL, _TOKENIZER


class EngineMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["recompute", "swap"]), blocks=st.integers(8, 14))
    def build(self, mode, blocks):
        faults.clear()
        model, tok = _model()
        config = EngineConfig(max_model_len=1024, num_kv_blocks=blocks, block_size=16, preemption_mode=mode,
                              swap_space=0.001, enable_prefix_caching=True, max_num_seqs=6,
                              max_num_batched_tokens=64)
        self.engine = LLMEngine(config, model=model, tokenizer=tok)
        self.ends: dict[str, int] = {}  # request id -> times it ended (finished output or abort)
        self.live: list[str] = []
        self.next_id = 0

    @precondition(lambda self: len(self.live) < 8)  # enough to keep the tiny KV cache over-subscribed
    @rule(reqs=st.lists(st.tuples(st.integers(1, 40), st.booleans(), st.integers(4, 40), st.integers(1, 2),
                                   st.booleans(), st.sampled_from([0.0, 0.8])), min_size=1, max_size=3))
    def add(self, reqs):
        for req in reqs:
            self._add(*req)

    def _add(self, prompt_len, shared, max_tokens, n, logprobs, temperature):
        rid = f"<{self.next_id:03d}>"
        self.next_id += 1
        prompt = (BASE if shared else []) + [(7 * self.next_id + i) % 1000 + 1 for i in range(prompt_len)]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=self.next_id,
                                logprobs=1 if logprobs else None)
        try:
            self.engine.add_request(rid, prompt, params)
        except ValueError:
            return  # can never fit: rejected up front, nothing to track
        self.ends[rid] = 0
        self.live.append(rid)

    @rule()
    def step(self):
        self._step()

    @rule(k=st.integers(1, 8))
    def steps(self, k):
        for _ in range(k):
            self._step()

    def _step(self):
        before = self.engine.scheduler.num_preemptions
        outputs = self.engine.step()
        STATS["steps"] += 1
        STATS["preemptions"] += self.engine.scheduler.num_preemptions - before
        for out in outputs:
            assert self.ends[out.request_id] == 0, f"output for {out.request_id} after it ended"
            if out.finished:
                self.ends[out.request_id] += 1
                self.live.remove(out.request_id)
                if not out.error:
                    STATS["finished"] += 1
                else:
                    assert all(c.finish_reason == "error" for c in out.outputs)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live))
        self.engine.abort_request(rid)
        self.engine.abort_request(rid)  # a second abort is a no-op
        self.ends[rid] += 1
        self.live.remove(rid)
        STATS["aborted"] += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), site=st.sampled_from(["sampler", "detok", "logprobs", "forward"]))
    def inject_fault(self, data, site):
        if site == "forward":  # the next step's forward; never so many in a row that the engine gives up
            if self.engine.fault_stats.consecutive_forward_failures == 0:
                faults.inject("forward", str(self.engine.num_steps + 1))
                STATS["faults"] += 1
            return
        faults.inject(site, data.draw(st.sampled_from(self.live)))
        STATS["faults"] += 1

    @invariant()
    def kv_consistent(self):
        if hasattr(self, "engine"):
            self.engine.check_kv_invariants()
            assert all(v <= 1 for v in self.ends.values()), "a request ended twice"

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        faults.clear()
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
            self.engine.check_kv_invariants()
        assert not self.engine.has_unfinished_requests(), "the engine did not drain"
        assert all(v == 1 for v in self.ends.values()), {k: v for k, v in self.ends.items() if v != 1}
        kv = self.engine.kv
        STATS["blocks_leaked"] += kv.num_blocks - kv.num_free_blocks + kv.num_host_blocks - len(kv.free_host_blocks)
        assert kv.all_free(), "KV blocks leaked"
        fs = self.engine.fault_stats
        STATS["failed_alone"] += fs.requests_failed_alone
        STATS["failed_collateral"] += fs.requests_failed_collateral
        STATS["forward_failures"] += fs.forward_failures
        STATS["examples"] += 1


EngineMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_engine_state_machine():
    start = time.monotonic()
    try:
        EngineMachine.TestCase("runTest").runTest()
    finally:
        faults.clear()
    print(f"\nstate machine: {STATS}, {time.monotonic() - start:.1f}s")
    assert STATS["examples"] >= 1
