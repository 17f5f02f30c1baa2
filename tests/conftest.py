"""Shared fixtures: a tiny random-weight Llama (same code path as the real model) and the real one.

Every engine a test builds is checked at teardown: no request left, all KV blocks free (cached-but-
free prefix blocks count as free), and the block accounting invariants hold.
"""

from __future__ import annotations

import pytest

from tokenloom import LLM, EngineConfig
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import bundled_model_path, random_model
from tokenloom.model.tokenizer import load_tokenizer

TINY = ModelConfig(
    vocab_size=49152,  # the real tokenizer's vocabulary, so text round-trips
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="session")
def tiny_model():
    return random_model(TINY, seed=0)


def assert_engine_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests(), "requests left behind"
    engine.check_kv_invariants()
    assert engine.kv.all_free(), f"KV blocks leaked: {engine.kv.num_free_blocks}/{engine.kv.num_blocks} free"


@pytest.fixture
def make_engine(tiny_model, tokenizer):
    """make_engine(**EngineConfig fields) -> LLMEngine on the tiny model; checked for leaks afterwards."""
    engines: list[LLMEngine] = []

    def make(**kwargs) -> LLMEngine:
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(**kwargs), model=tiny_model, tokenizer=tokenizer)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_engine_clean(engine)


@pytest.fixture
def make_llm(make_engine):
    return lambda **kwargs: LLM(engine=make_engine(**kwargs))


@pytest.fixture(scope="session")
def real_llm():
    """The bundled SmolLM2-135M in float32 (loaded once per session)."""
    return LLM(dtype="float32", max_num_batched_tokens=256)


@pytest.fixture
def clean_real_llm(real_llm):
    yield real_llm
    assert_engine_clean(real_llm.engine)
