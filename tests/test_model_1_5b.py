"""Qwen2.5-Coder-1.5B (28 layers, d=1536; Q4_K and Q6_K blocks), in a module of its own so that no other
test's model is held while it loads (a server on it peaked at 2.8 GB, KV cache included)."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams


@pytest.mark.slow
def test_qwen_1_5b_serves_on_the_fast_path():
    """Pulled, loaded on the fast path with the decoder loop, writes code."""
    from tokenloom.model import catalog

    llm = LLM(model=str(catalog.pull("qwen2.5-coder-1.5b", progress=False, log=lambda _: None)),
              quantization="auto", max_model_len=1024,
              kv_cache_memory_bytes=1 << 28)
    plan = llm.engine.runner.model.plan
    assert plan.architecture == "qwen2" and "Q4_K" in plan.weight_sources and plan.weights.startswith("int4")
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "return" in out.outputs[0].text, out.outputs[0].text
