"""Integration tests on the real bundled SmolLM2-135M-Instruct (float32): parity with Hugging Face
`transformers` (golden tokens made by scripts/make_golden.py), batch invariance, the tokenizer and
chat template, and the CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tokenloom import SamplingParams

pytestmark = pytest.mark.slow
GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_greedy.json")


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        return json.load(f)


def test_greedy_tokens_match_transformers_exactly(clean_real_llm, golden):
    cases = golden["cases"]
    assert len(cases) >= 8 and all(len(c["output_token_ids"]) >= 32 for c in cases)
    chunk = clean_real_llm.engine.config.max_num_batched_tokens
    assert any(len(c["prompt_token_ids"]) > chunk for c in cases), "a prompt longer than the prefill chunk"
    assert any(c["kind"] == "chat" for c in cases)
    outs = clean_real_llm.generate(
        [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases],
        SamplingParams(temperature=0, max_tokens=len(cases[0]["output_token_ids"]), ignore_eos=True),
        use_tqdm=False,
    )
    for case, out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == case["output_token_ids"], case["name"]


def test_tokenizer_and_chat_template_match_transformers(real_llm, golden):
    tok = real_llm.tokenizer
    for case in golden["cases"]:
        if case["kind"] == "chat":
            assert tok.apply_chat_template(case["messages"]) == case["prompt"], case["name"]
        assert tok.encode(case["prompt"]) == case["prompt_token_ids"], case["name"]


def test_greedy_is_batch_invariant_with_staggered_arrivals(clean_real_llm):
    """Each prompt alone, then all 16 (mixed lengths) arriving at different steps of one batch."""
    engine = clean_real_llm.engine
    rng = random.Random(5)
    words = ["the", "of", "a", "model", "token", "batch", "cache", "river", "light", "stone", "music", "eleven", "paper", "night"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 300))) for _ in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.kv.reset_prefix_cache()
    alone = [clean_real_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    engine.kv.reset_prefix_cache()
    pending, done, step, widest = list(enumerate(prompts)), {}, 0, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"inv{i}", p, sp)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[3:])] = out.outputs[0].token_ids
        widest = max(widest, engine.last_step.num_seqs)
        step += 1
    assert widest >= 8, "the requests should have shared steps"
    assert [done[i] for i in range(16)] == alone


def test_cli_generate_json():
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "generate", "--prompt", "The capital of France is",
         "--max-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"token_ids", "text", "finish_reason"}
    assert len(result["token_ids"]) <= 8 and result["text"].strip().startswith("Paris")
    # serve's forward path by default, named in the log
    assert "forward plan:" in proc.stderr and "(asked auto" in proc.stderr, proc.stderr


def test_bad_model_files_give_clear_errors(tmp_path):
    from tokenloom import LLM

    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        LLM(model=str(corrupt))
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "missing.gguf"))
