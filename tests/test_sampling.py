"""Each sampling parameter, on the tiny random-weight model (same code path as the real one)."""

from __future__ import annotations

import pytest

from tokenloom import SamplingParams

PROMPTS = ["Hello, my name is", "The weather today", "In 1492, Columbus"]


def gen(llm, prompts=PROMPTS, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_top_k_1_equals_greedy(make_llm):
    llm = make_llm()
    greedy = tokens(gen(llm, temperature=0, max_tokens=12, ignore_eos=True))
    topk1 = tokens(gen(llm, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True))
    assert topk1 == greedy


def test_tiny_top_p_and_full_min_p_equal_greedy(make_llm):
    llm = make_llm()
    greedy = tokens(gen(llm, temperature=0, max_tokens=10, ignore_eos=True))
    assert tokens(gen(llm, temperature=0.8, top_p=1e-6, max_tokens=10, ignore_eos=True)) == greedy
    assert tokens(gen(llm, temperature=0.8, min_p=1.0, max_tokens=10, ignore_eos=True)) == greedy


def test_seed_reproduces_and_differs(make_llm):
    llm = make_llm()
    a = tokens(gen(llm, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    b = tokens(gen(llm, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    c = tokens(gen(llm, temperature=1.0, seed=8, max_tokens=16, ignore_eos=True))
    assert a == b
    assert a != c


def test_seeded_sample_independent_of_batch(make_llm):
    llm = make_llm()
    alone = tokens(gen(llm, prompts=[PROMPTS[0]], temperature=1.0, seed=3, max_tokens=16, ignore_eos=True))[0]
    outs = llm.generate(
        PROMPTS,
        [SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)]
        + [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 2,
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == alone


def test_max_tokens_and_finish_reason(make_llm):
    out = gen(make_llm(), temperature=0, max_tokens=5, ignore_eos=True)
    for o in out:
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].finish_reason == "length"


def test_stop_string_cuts_text_exactly(make_llm):
    llm = make_llm()
    full = gen(llm, prompts=[PROMPTS[0]], temperature=0, max_tokens=24, ignore_eos=True)[0].outputs[0]
    stop = full.text[8:11]  # a piece from the middle of the text
    assert stop.strip(), "need a visible stop string"
    cut = gen(llm, prompts=[PROMPTS[0]], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = gen(
        llm, prompts=[PROMPTS[0]], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids(make_llm):
    llm = make_llm()
    full = gen(llm, prompts=[PROMPTS[1]], temperature=0, max_tokens=20, ignore_eos=True)[0].outputs[0]
    target = full.token_ids[6]
    first = full.token_ids.index(target)
    out = gen(llm, prompts=[PROMPTS[1]], temperature=0, max_tokens=20, stop_token_ids=[target])[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored_and_min_tokens_bans_it(make_llm, tokenizer):
    llm = make_llm()
    full = gen(llm, prompts=[PROMPTS[2]], temperature=0, max_tokens=20, ignore_eos=True)[0].outputs[0]
    # Pretend the 5th generated token is an end-of-sequence token by making it a stop token id:
    eos_like = full.token_ids[4]
    out = gen(
        llm, prompts=[PROMPTS[2]], temperature=0, max_tokens=20, stop_token_ids=[eos_like],
        min_tokens=full.token_ids.index(eos_like) + 2,
    )[0].outputs[0]
    assert len(out.token_ids) >= full.token_ids.index(eos_like) + 2
    assert eos_like not in out.token_ids[: full.token_ids.index(eos_like) + 2]


def test_logprobs_top_n_include_chosen(make_llm):
    out = gen(make_llm(), prompts=[PROMPTS[0]], temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 6
    for token, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert token in lp and len(lp) == 3  # greedy: the chosen token is the top one
        assert lp[token] == pytest.approx(max(lp.values()))
        assert all(v <= 0 for v in lp.values())


def test_prompt_logprobs(make_llm):
    out = gen(make_llm(max_num_batched_tokens=4), prompts=[PROMPTS[2]], temperature=0, max_tokens=2, prompt_logprobs=1)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in lp


def test_n_greater_than_one_shares_prompt_blocks(make_llm):
    llm = make_llm(block_size=4)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Children 1 and 2 reused the full prompt blocks computed for child 0.
    assert llm.engine.kv.prefix_hits >= 2 * ((len(out.prompt_token_ids) - 1) // 4) * 4


def test_penalties_change_output(make_llm):
    llm = make_llm()
    base = tokens(gen(llm, temperature=0, max_tokens=16, ignore_eos=True))
    for kw in ({"repetition_penalty": 1.8}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}):
        changed = tokens(gen(llm, temperature=0, max_tokens=16, ignore_eos=True, **kw))
        assert changed != base, kw


def test_frequency_penalty_discourages_repeats(make_llm):
    llm = make_llm()
    plain = gen(llm, temperature=0, max_tokens=30, ignore_eos=True)
    penal = gen(llm, temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0)

    def repeats(outs):
        return sum(len(o.outputs[0].token_ids) - len(set(o.outputs[0].token_ids)) for o in outs)

    assert repeats(penal) <= repeats(plain)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1), ("top_p", 0), ("top_k", -2), ("min_p", 2), ("max_tokens", 0), ("n", 0),
     ("repetition_penalty", 0), ("presence_penalty", 3), ("logprobs", 21), ("stop", [""])],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_are_normalised_once():
    """The offline API and the server share these: None = default, stop str or list, top_k off values."""
    sp = SamplingParams(temperature=None, top_p=None, min_p=None, repetition_penalty=None, top_k=None,
                        stop="##", stop_token_ids=None)
    assert (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.top_k) == (1.0, 1.0, 0.0, 1.0, 0)
    assert sp.stop == ["##"] and sp.stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None  # None is a value here: up to the context


def test_prompt_logprobs_survive_recompute_preemption(make_llm):
    """A tight KV cache preempts some of these mid-prompt; each still reports one logprob per prompt token."""
    llm = make_llm(num_kv_blocks=10, block_size=8, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(100 + 40 * i, 140 + 40 * i))} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    for out, ref in zip(outs, alone, strict=True):
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert got.keys() == want.keys()
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "x"), ("repetition_penalty", float("nan")),
     ("repetition_penalty", float("inf")), ("top_p", float("nan")), ("min_p", float("nan")),
     ("presence_penalty", float("-inf")), ("frequency_penalty", "1"), ("top_k", 10**30), ("top_k", 1.5),
     ("priority", 10**400), ("priority", 2**40), ("seed", 2**64), ("seed", "7"), ("n", 129), ("n", 10**23),
     ("n", True), ("n", 2.0), ("max_tokens", 10**30), ("min_tokens", -1), ("logprobs", True),
     ("stop", ["s"] * 65), ("stop", "x" * 1025), ("stop", 5), ("stop_token_ids", [1.5]), ("stop_token_ids", "12"),
     ("stop_token_ids", list(range(2000))), ("ignore_eos", "yes"), ("predicted_output_len", -1)],
)
def test_hostile_values_are_value_errors_naming_the_field(field, value):
    """The offline API gets the server's checks: wrong types are ValueError too, never TypeError."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bounds_are_inclusive():
    sp = SamplingParams(n=128, seed=2**63 - 1, priority=-(2**31), top_k=2**63 - 1, stop=["s"] * 64,
                        temperature=0, repetition_penalty=1e4)
    assert sp.n == 128 and sp.seed == 2**63 - 1


def test_request_checks_are_model_dependent_bounds():
    from tokenloom.request_checks import check_request

    ok = SamplingParams(max_tokens=4, stop_token_ids=[49151])
    check_request(ok, [1, 2, 3], vocab_size=49152, max_model_len=8)
    cases = [
        (SamplingParams(stop_token_ids=[60000], min_tokens=2), [1], "stop_token_ids"),
        (SamplingParams(), [1, 49152], "prompt"),
        (SamplingParams(), [], "prompt"),
        (SamplingParams(max_tokens=None), list(range(8)), "prompt"),
        (SamplingParams(max_tokens=6), [1, 2, 3], "max_tokens"),
        (SamplingParams(max_tokens=None, min_tokens=6), [1, 2, 3], "min_tokens"),
    ]
    for params, ids, field in cases:
        with pytest.raises(ValueError, match=f"^{field}"):
            check_request(params, ids, vocab_size=49152, max_model_len=8)


def test_logprob_tokens_keep_their_bytes(tokenizer):
    from tokenloom.server import convert

    ids = tokenizer.encode(" 日本")
    texts = [convert.token_text(tokenizer, i) for i in ids]
    assert len(set(texts)) == len(texts) and any(t.startswith("bytes:") for t in texts)
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode() == " 日本"
    assert tokenizer.token_bytes(tokenizer.encode("<|im_start|>")[0]) == b"<|im_start|>"
    # echo + logprobs on a one-token prompt: the engine gives no entry for the first token.
    part = convert.CompletionLogprobs(tokenizer).part([tokenizer.encode("Hi")[0]], [])
    assert part["token_logprobs"] == [None] and part["top_logprobs"] == [None]
    chat = convert.chat_logprobs(tokenizer, ids, [{i: -0.5, 5: float("-inf")} for i in ids], 2)
    assert [bytes(c["bytes"]) for c in chat["content"]] == [tokenizer.token_bytes(i) for i in ids]
    assert all(t["logprob"] == -9999.0 for c in chat["content"] for t in c["top_logprobs"] if t["logprob"] < -1)
