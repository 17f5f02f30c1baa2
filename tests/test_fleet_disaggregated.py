"""Disaggregated prefill on a real fleet (`--prefill-replicas 1 --data-parallel-size 1`): a prefill
replica computes each prompt's K/V, the decode replica imports it into its prefix cache and continues;
greedy output equals one engine's, token for token (float32)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from conftest_fleet import FleetProcess, replica_totals

from tokenloom import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Summarize: " + " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "blue", "green"] * 8)),
    "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively\n    " * 4,
]


@pytest.fixture(scope="module")
def fleet():
    srv = FleetProcess([], replicas=["--prefill-replicas", "1", "--data-parallel-size", "1"])
    yield srv
    srv.stop()


def test_decode_after_a_handed_over_prefill_matches_one_engine(fleet, real_llm):
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, real_llm.generate(PROMPTS, params, use_tqdm=False),
                                                      strict=True)}
    with fleet.client() as http:
        def one(prompt: str) -> str:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = dict(zip(PROMPTS, pool.map(one, PROMPTS), strict=True))
    assert got == expected
    time.sleep(2.5)  # the replicas report every second
    hits, _ = replica_totals(fleet.url, "tokenloom:prefix_cache_hits_total")
    prompt_tokens, _ = replica_totals(fleet.url, "tokenloom:prompt_tokens_total")
    assert len(hits) == 2
    # The decode replica (the one with no prompt tokens of its own beyond the tails) hit the handed K/V.
    decode = max(hits, key=hits.get)
    assert hits[decode] >= 16 * 2 and prompt_tokens[decode] < sum(prompt_tokens.values())
