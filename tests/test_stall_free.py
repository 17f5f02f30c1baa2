"""Stall-free batching (engine/step_cost.py): prefill chunks beside decodes are sized from the fitted
step cost so the step stays within `stall_free_factor` x the decode-only step; a long prompt still
moves on every step; without decodes a prompt takes the whole budget."""

from __future__ import annotations

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.step_cost import OnlineStepCost
from tokenloom.step import StepShape

GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
MS = 1e-3


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def fitted(factor: float = 3.0) -> OnlineStepCost:
    """A cost model taught by steps costing 10 ms + 1 ms a token (exact, so the fit is too)."""
    cost = OnlineStepCost(block_size=16, factor=factor, refit_every=8, min_samples=8)
    for decodes in range(1, 9):
        for chunk in (0, 16, 40, 100):
            rows = [(1, 50)] * decodes + ([(chunk, chunk)] if chunk else [])
            cost.observe(StepShape(rows, len(rows), 0), (10 + decodes + chunk) * MS)
    assert cost.model is not None
    return cost


def test_fit_and_chunk_limit():
    cost = fitted()
    decodes = [(1, 50)] * 8  # 18 ms alone, so 54 ms allowed: 36 prefill tokens
    assert cost.predict(decodes) == pytest.approx(18 * MS, rel=0.02)
    assert cost.chunk_limit(decodes, [], 0, 500) == pytest.approx(36, abs=1)
    assert cost.chunk_limit(decodes, [], 0, 20) == 20  # never more than asked
    assert cost.chunk_limit([], [], 0, 500) == 500  # nobody decodes: the whole budget
    assert cost.chunk_limit(decodes, [(36, 36)], 0, 500) <= 1  # the step is full
    assert fitted(factor=1.0).chunk_limit(decodes, [], 0, 500) == 16  # the first chunk always moves: min_chunk


def test_cold_model_gives_a_small_fixed_chunk():
    cost = OnlineStepCost(block_size=16, factor=1.5, cold_chunk=64)
    assert cost.chunk_limit([(1, 10)], [], 0, 500) == 64
    assert cost.chunk_limit([(1, 10)], [(60, 60)], 0, 500) == 4


def test_engine_slices_a_long_prompt_beside_decodes(make_engine):
    engine = make_engine(max_num_batched_tokens=256, stall_free_factor=1.5)
    engine.step_cost.cold_chunk = 24
    for i in range(3):
        engine.add_request(f"s{i}", ids(6, 100 + 10 * i), GREEDY)
    engine.step()  # their prefills: nobody decodes yet, whole budget
    assert engine.last_step.num_prefill_tokens == 18
    engine.add_request("long", ids(200, 1000), GREEDY)
    long_seq = engine.requests["long"].seqs[0]
    chunks = []
    while long_seq.num_computed_tokens < 200:
        before = long_seq.num_computed_tokens
        engine.step()
        assert engine.last_step.num_decode_tokens == 3  # the streams decode every step
        chunks.append(long_seq.num_computed_tokens - before)
    assert chunks[0] == 24 and all(0 < c <= 256 for c in chunks), chunks
    assert len(chunks) > 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_kv_invariants()


def test_stall_free_factor_is_checked(make_engine):
    with pytest.raises(ValueError, match="stall_free_factor"):
        make_engine(stall_free_factor=0.5)
    with pytest.raises(ValueError, match="stall_free_factor"):
        make_engine(stall_free_factor=float("nan"))
