"""Per-request constraints in the batched sampler, on the tiny random model: logit bias, allowed ids,
bad words, grammars (regex, choice, EBNF, JSON schema), jump-forward, and batch invariance."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenloom import SamplingParams
from tokenloom.sampling_params import StructuredOutputsParams

PROMPT = "The weather today is"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), ignore_eos=True, **kw)


def test_logit_bias_changes_and_forces(make_llm):
    llm = make_llm()
    base = llm.generate([PROMPT], greedy(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    pushed = llm.generate([PROMPT], greedy(max_tokens=1, logit_bias={base: -100}), use_tqdm=False)[0]
    assert pushed.outputs[0].token_ids[0] != base
    forced = llm.generate([PROMPT], greedy(max_tokens=4, logit_bias={"1234": 100}), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [1234] * 4


def test_allowed_token_ids_restrict_sampling(make_llm):
    allowed = [100, 200, 300]
    outs = make_llm().generate(
        [PROMPT] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed),
        use_tqdm=False,
    )
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_never_appear(make_llm, tokenizer):
    llm = make_llm()
    free = llm.generate([PROMPT], greedy(max_tokens=12), use_tqdm=False)[0].outputs[0]
    word = tokenizer.decode(free.token_ids[2:4]).strip()  # a word the model does write here
    assert word
    out = llm.generate([PROMPT], greedy(max_tokens=12, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    for ids in ([*tokenizer.encode(word)], [*tokenizer.encode(" " + word)]):
        assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids)))


def test_ids_beyond_the_vocabulary_are_refused(make_engine):
    engine = make_engine()
    for field in ("stop_token_ids", "allowed_token_ids"):
        with pytest.raises(ValueError, match=field):
            engine.add_request("r", PROMPT, SamplingParams(**{field: [60000]}, min_tokens=1))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r", PROMPT, SamplingParams(logit_bias={60000: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def structured(kind, value, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: value}), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammars_hold_on_a_random_model(make_llm, temperature):
    """A random-weight model writes noise; the grammar alone makes every output valid."""
    llm = make_llm()
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["sunny", "rainy", "windy and cold"]
    ebnf = 'root ::= "(" num ("+" num){1,3} ")"\nnum ::= [1-9] [0-9]?'
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
              "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 1, "maxItems": 3}}, "required": ["city", "days"], "additionalProperties": False}
    params = [structured("regex", regex), structured("choice", choices), structured("grammar", ebnf),
              structured("json", schema)]
    outs = llm.generate([PROMPT] * 4, [p.clone(temperature=temperature, seed=7) for p in params], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(regex, texts[0])
    assert texts[1] in choices
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){1,3}\)", texts[2])
    jsonschema.validate(json.loads(texts[3]), schema)


def test_jump_forward_appends_fixed_keys_without_a_forward(make_engine):
    engine = make_engine()
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"type": "boolean"},
              "another_quite_long_property_name": {"type": "boolean"}},
              "required": ["a_rather_long_property_name", "another_quite_long_property_name"],
              "additionalProperties": False}
    engine.add_request("r", PROMPT, structured("json", schema, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
    tokens = len(out[0].outputs[0].token_ids)
    assert json.loads(out[0].outputs[0].text).keys() == schema["properties"].keys()
    assert tokens >= 2 * (steps - 1), (tokens, steps)  # the first step is the prompt's prefill


def test_unconstrained_neighbour_is_unchanged(make_llm):
    llm = make_llm()
    alone = llm.generate([PROMPT], greedy(max_tokens=16), use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [PROMPT, "Once upon a time", "Numbers:"],
        [greedy(max_tokens=16), structured("regex", "[a-z ]{5,40}", temperature=0),
         greedy(max_tokens=16, logit_bias={5: 50.0}, bad_words=["the"])],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone


def test_allowed_ids_win_over_bans_that_leave_nothing(make_llm, tokenizer):
    """Only the end-of-sequence token is allowed while min_tokens bans it: the allowed set wins
    (never a token outside it, never NaN sampling)."""
    eos = tokenizer.eos_token_ids[0]
    for temperature in (0.0, 1.0):
        out = make_llm().generate([PROMPT], SamplingParams(temperature=temperature, seed=1, max_tokens=5, min_tokens=3,
                                                           allowed_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
        assert out.token_ids and set(out.token_ids) == {eos}
