"""The scheduler's token budget, chunked prefill, admission and retirement, on the tiny model."""

from __future__ import annotations

from tokenloom import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_budget_and_chunked_prefill_mix_with_decodes(make_engine):
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=8)
    engine.add_request("short", ids(5), GREEDY)
    engine.step()  # prefill of "short" (5 tokens); from now on it decodes
    engine.add_request("long", ids(40, 500), GREEDY)
    long_seq = engine.requests["long"].seqs[0]
    steps = []
    while long_seq.num_computed_tokens < 40:
        before = long_seq.num_computed_tokens
        engine.step()
        steps.append((long_seq.num_computed_tokens - before, "short#0" in engine.last_step.seq_ids))
        assert engine.last_step.num_batched_tokens <= 16
    # Each step: one decode token for "short" and the rest of the budget as a chunk of "long".
    assert steps == [(15, True), (15, True), (10, True)]
    while engine.has_unfinished_requests():
        engine.step()


def test_prompt_is_split_into_budget_sized_chunks(make_engine):
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("r", ids(30), GREEDY)
    sizes = []
    seq = engine.requests["r"].seqs[0]
    while seq.num_computed_tokens < 30:
        before = seq.num_computed_tokens
        engine.step()
        sizes.append(seq.num_computed_tokens - before)
    assert sizes == [8, 8, 8, 6]
    while engine.has_unfinished_requests():
        engine.step()


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget(make_engine):
    engine = make_engine(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64)
    engine.add_request("a", ids(40), GREEDY)
    engine.add_request("b", ids(40, 900), GREEDY)
    engine.step()
    assert engine.last_step.seq_ids == ["a#0"]  # b's 40 tokens do not fit the 24 left
    while engine.has_unfinished_requests():
        engine.step()


def test_max_num_seqs_caps_running(make_engine):
    engine = make_engine(max_num_seqs=3)
    for i in range(6):
        engine.add_request(f"r{i}", ids(4, 100 + 10 * i), GREEDY)
    engine.step()
    st = engine.stats()
    assert st.num_running == 3 and st.num_waiting == 3
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.stats().num_running <= 3


def test_finished_leave_and_waiting_join_at_once(make_engine):
    engine = make_engine(max_num_seqs=2)
    engine.add_request("short", ids(4), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.add_request("long", ids(4, 300), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request("next", ids(4, 600), GREEDY)
    finished_at = joined_at = None
    for step in range(30):
        outs = engine.step()
        if any(o.request_id == "short" and o.finished for o in outs):
            finished_at = step
        if "next#0" in engine.last_step.seq_ids and joined_at is None:
            joined_at = step
        if not engine.has_unfinished_requests():
            break
    assert joined_at == finished_at + 1  # the very next step


def test_blocks_allocated_lazily_and_freed(make_engine):
    engine = make_engine(block_size=4, enable_prefix_caching=False)
    engine.add_request("r", ids(6), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    seq = engine.requests["r"].seqs[0]
    engine.step()
    assert len(seq.block_table) == 2  # 6 prompt tokens → 2 blocks, nothing reserved ahead
    engine.step()  # computes token 7 (KV for 7 tokens)
    assert len(seq.block_table) == 2
    engine.step()
    engine.step()  # 9 tokens of KV → a third block
    assert len(seq.block_table) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.all_free()


def test_abort_frees_blocks_mid_prefill_and_mid_decode(make_engine):
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("a", ids(30), GREEDY)
    engine.add_request("b", ids(3, 700), GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.kv.all_free()
    assert not engine.has_unfinished_requests()


def test_too_long_prompt_and_context_errors(make_engine):
    import pytest

    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", ids(64), GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("y", ids(60), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("z", [10**9], GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("w", [], GREEDY)
    assert not engine.has_unfinished_requests()
