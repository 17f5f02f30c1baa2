"""Stall-free batching (engine/stall_free.py): beside decodes, prefill chunks are capped by an allowance
steered by measured step times against `stall_free_factor` x the predicted decode-only step; a long
prompt still moves on every step; without decodes a prompt takes the whole budget."""

from __future__ import annotations

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.stall_free import StallFreeBudget
from tokenloom.step import StepShape

GREEDY = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
MS = 1e-3


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def taught(factor: float = 1.5) -> StallFreeBudget:
    """Decode-only steps costing 10 ms + 1 ms a sequence (exact, so the fit is too)."""
    budget = StallFreeBudget(block_size=16, factor=factor, refit_every=4, min_samples=4, start_tokens=16)
    for decodes in range(1, 9):
        rows = [(1, 50)] * decodes
        budget.observe(StepShape(rows, decodes, 0), (10 + decodes) * MS, rows, 0)
    assert budget.decode_model is not None
    return budget


def test_decode_time_is_learned_from_decode_only_steps():
    budget = taught()
    assert budget.decode_time([(1, 50)] * 8) == pytest.approx(18 * MS, rel=0.02)


def test_allowance_shrinks_after_a_slow_step_and_grows_after_a_fast_one():
    budget = taught()
    decodes = [(1, 50)] * 8  # 18 ms alone: a step with prefill should take <= 27 ms
    def step(chunk: int, ms: float) -> None:
        budget.observe(StepShape([*decodes, (chunk, chunk)], 9, 0), ms * MS, decodes, chunk)

    step(16, 54)  # 2x over target
    assert budget.allowance == int(16 / 2 * 0.9) == 7
    step(7, 13.5)  # half the target, limited by it
    assert budget.allowance == 12  # 7 / 0.5 * 0.9, at most 2 x 7
    step(5, 13.5)  # under target but not limited: keep
    assert budget.allowance == 12
    step(12, 500)
    assert budget.allowance == 1  # never below min_chunk
    step(1, 13.5)  # a one-token prompt slice is prefill too: the allowance grows again
    assert budget.allowance == 2


def test_chunk_limit():
    budget = taught()
    budget.allowance = 20
    assert budget.chunk_limit(False, 0, 500) == 500  # nobody decodes: the whole budget
    assert budget.chunk_limit(True, 0, 500) == 20
    assert budget.chunk_limit(True, 0, 8) == 8
    assert budget.chunk_limit(True, 15, 500) == 5
    assert budget.chunk_limit(True, 20, 500) == 0
    budget.allowance = 0
    assert budget.chunk_limit(True, 0, 500) == 1  # the step's first chunk always moves


def test_no_cap_before_the_decode_cost_is_known():
    budget = StallFreeBudget(block_size=16, factor=1.5)
    assert budget.chunk_limit(True, 0, 500) == 500


def test_engine_slices_a_long_prompt_beside_decodes(make_engine):
    engine = make_engine(max_num_batched_tokens=128, stall_free_factor=1.5)
    for i in range(3):
        engine.add_request(f"s{i}", ids(6, 100 + 10 * i), GREEDY)
    engine.step()  # their prefills: nobody decodes yet, whole budget
    assert engine.last_step.num_prefill_tokens == 18
    for _ in range(20):  # decode-only steps: the engine learns what they cost
        engine.step()
    assert engine.stall_free.decode_model is not None
    engine.add_request("long", ids(200, 1000), GREEDY)
    long_seq = engine.requests["long"].seqs[0]
    streams = [engine.requests[f"s{i}"].seqs[0] for i in range(3)]
    chunks = []
    while long_seq.num_computed_tokens < 200:
        before = long_seq.num_computed_tokens
        outputs = [len(s.output_token_ids) for s in streams]
        engine.step()
        # The streams decode every step (counted per stream: a one-token slice of the prompt, which the
        # allowance may come down to on a slow machine, has the shape of a decode).
        assert [len(s.output_token_ids) for s in streams] == [n + 1 for n in outputs]
        chunks.append(long_seq.num_computed_tokens - before)
    assert chunks[0] == 16 and all(0 < c <= 128 for c in chunks), chunks
    engine.add_request("short", ids(100, 3000), GREEDY)  # fits one step's budget: not sliced
    engine.step()
    assert engine.requests["short"].seqs[0].num_computed_tokens == 100
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_kv_invariants()


def test_stall_free_factor_is_checked(make_engine):
    with pytest.raises(ValueError, match="stall_free_factor"):
        make_engine(stall_free_factor=0.5)
    with pytest.raises(ValueError, match="stall_free_factor"):
        make_engine(stall_free_factor=float("nan"))
