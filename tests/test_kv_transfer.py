"""K/V handed from one engine to another through the prefix cache (disaggregated prefill): the receiving
engine's greedy tokens equal an engine that computed the prompt itself, and nothing leaks."""

import pytest
import torch
from conftest import assert_engine_clean

from tokenloom import SamplingParams

PROMPT = list(range(100, 150))  # 50 tokens: 3 whole blocks of 16 and a partial one


def _run(engine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                          ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    return out.outputs[0].token_ids


def test_a_prefill_engines_kv_gives_the_same_tokens(make_engine):
    prefill, decode, alone = make_engine(), make_engine(), make_engine()
    _run(prefill, "p", PROMPT, 1)
    tokens, kv = prefill.export_prefix_kv(PROMPT)
    assert tokens == 48 and kv.shape[2] == 48
    assert decode.import_prefix_kv(PROMPT, kv) == 48
    assert decode.kv.prefix_hits == 0
    got = _run(decode, "d", PROMPT, 12)
    assert decode.kv.prefix_hits == 48  # the decode engine computed only the last 2 prompt tokens
    assert got == _run(alone, "a", PROMPT, 12)
    for engine in (prefill, decode, alone):
        assert_engine_clean(engine)


def test_nothing_cached_exports_nothing_and_wrong_shapes_are_refused(make_engine):
    a, b = make_engine(), make_engine()
    assert a.export_prefix_kv(PROMPT) == (0, None)
    assert b.import_prefix_kv(PROMPT, None) == 0
    _run(a, "p", PROMPT, 1)
    _, kv = a.export_prefix_kv(PROMPT)
    with pytest.raises(ValueError, match="kv:"):
        b.import_prefix_kv(PROMPT, kv.to(torch.float64))
    assert_engine_clean(b)


def test_an_import_takes_at_most_a_quarter_of_the_free_blocks(make_engine):
    a, b = make_engine(), make_engine(num_kv_blocks=8)
    _run(a, "p", PROMPT, 1)
    _, kv = a.export_prefix_kv(PROMPT)
    assert b.import_prefix_kv(PROMPT, kv) == 32  # 2 of 8 blocks
    assert_engine_clean(b)


def test_a_model_with_sliding_windows_hands_over_every_kv_group(tokenizer):
    """Gemma 3's layout in small (a full layer and five with an 8-token window, a KV group each): the
    prefill engine's sliding groups released the blocks behind their window, which stay cached, so the
    hand-over carries all six groups' blocks, and the decode engine's tokens equal its own."""
    import dataclasses

    from test_architectures import GEMMA3

    from tokenloom import EngineConfig
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import random_model

    model = random_model(dataclasses.replace(GEMMA3, vocab_size=tokenizer.vocab_size), seed=5)

    def engine():
        return LLMEngine(EngineConfig(max_num_batched_tokens=16, max_model_len=256, num_kv_blocks=256),
                         model=model, tokenizer=tokenizer)

    prefill, decode, alone = engine(), engine(), engine()
    assert prefill.kv.num_groups == 6
    _run(prefill, "p", PROMPT, 1)
    tokens, kv = prefill.export_prefix_kv(PROMPT)
    assert tokens == 48 and kv.shape[2] == 6 * 48
    assert decode.import_prefix_kv(PROMPT, kv) == 48
    got = _run(decode, "d", PROMPT, 12)
    assert decode.kv.prefix_hits == 48
    assert got == _run(alone, "a", PROMPT, 12)
    # An engine handed the same K/V for a shorter prompt takes each group's first blocks from their place.
    short, short_alone = engine(), engine()
    assert short.import_prefix_kv(PROMPT[:40], kv) == 32
    assert _run(short, "s", PROMPT[:40], 12) == _run(short_alone, "sa", PROMPT[:40], 12)
    with pytest.raises(ValueError, match="kv:"):
        short.import_prefix_kv(PROMPT, kv[:, :, :-16])
    for e in (prefill, decode, alone, short, short_alone):
        assert_engine_clean(e)
