"""SamplingParams.pool_hidden (issue 55's probe): the engine returns the mean final hidden state over the
tokens it ran for a request, the same however the prompt is chunked, and never from the prefix cache."""

from __future__ import annotations

import numpy as np

from tokenloom.sampling_params import SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens: several chunks at 16 per step


def pooled(llm, prompt=PROMPT, max_tokens=1, field="pooled_hidden") -> np.ndarray:
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, pool_hidden=True),
                       use_tqdm=False)[0]
    return np.array(getattr(out.outputs[0], field))


def test_pooled_hidden_is_chunking_independent_and_skips_the_prefix_cache(make_llm):
    whole = make_llm(max_num_batched_tokens=256, enable_prefix_caching=True)
    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=True)
    a = pooled(whole)
    assert a.shape == (whole.engine.model.config.hidden_size,) and np.isfinite(a).all()
    np.testing.assert_allclose(pooled(chunked), a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pooled(whole), a, rtol=1e-5, atol=1e-6)  # again: a cache hit would pool fewer rows
    assert not np.allclose(pooled(whole, prompt=list(range(50, 90))), a)
    assert not np.allclose(pooled(whole, max_tokens=4), a)  # the generated tokens' rows count as well
    np.testing.assert_allclose(pooled(chunked, max_tokens=4, field="prompt_hidden"), a, rtol=1e-4, atol=1e-5)


def test_no_pooled_hidden_unless_asked(make_llm):
    llm = make_llm()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].pooled_hidden is None
