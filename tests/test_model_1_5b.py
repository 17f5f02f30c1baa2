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


@pytest.mark.slow
def test_qwen_0_5b_drafting_for_the_1_5b_writes_the_same_tokens():
    """The draft-model pair (engine/draft_model.py) on the real files: greedy tokens identical with the
    0.5B drafting, alone and batched, and most of its drafts accepted on code."""
    from tokenloom.model import catalog

    target, draft = (str(catalog.pull(name, progress=False, log=lambda _: None))
                     for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    prompts = ['def is_prime(n: int) -> bool:\n    """Return True if n is a prime number."""\n',
               'class Stack:\n    """A last-in, first-out stack backed by a Python list."""\n\n    def __init__(self):\n']
    params = SamplingParams(temperature=0, max_tokens=48)
    results = []
    for spec in (None, {"model": draft, "num_speculative_tokens": 4, "adaptive": False}):
        llm = LLM(model=target, quantization="auto", max_model_len=1024, kv_cache_memory_bytes=1 << 27,
                  speculative_config=spec)
        alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        results.append((alone, batched))
        if spec is not None:
            st = llm.engine.speculation.stats
            assert st.num_accepted_tokens > 0.6 * st.num_draft_tokens > 40, st
            assert llm.engine.speculation.draft.kv.all_free()
        del llm
    assert results[1] == results[0]
    assert results[0][0] == results[0][1]
