"""Structured outputs on the real bundled model (float32): 20 JSON schemas, greedy and sampled; regex,
choice and EBNF on 50 sampled outputs each; logit bias and allowed ids; jump-forward's tokens per forward."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from tokenloom import SamplingParams
from tokenloom.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow
SCHEMAS = os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")
SEEDS = range(5)


def chat_prompt(llm, text: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_every_output_validates_against_its_schema(clean_real_llm):
    with open(SCHEMAS) as f:
        schemas = json.load(f)
    assert len(schemas) >= 20
    prompts, params, expected = [], [], []
    for name, schema in schemas.items():
        prompt = chat_prompt(clean_real_llm, f"Write one JSON example of a {name.replace('_', ' ')}.")
        so = StructuredOutputsParams(json=schema)
        runs = [SamplingParams(temperature=0, max_tokens=256, structured_outputs=so)]
        runs += [SamplingParams(temperature=1.0, seed=s, max_tokens=256, structured_outputs=so) for s in SEEDS]
        prompts += [prompt] * len(runs)
        params += runs
        expected += [(name, schema)] * len(runs)
    outs = clean_real_llm.generate(prompts, params, use_tqdm=False)
    for out, (name, schema) in zip(outs, expected, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", (name, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.parametrize(
    "kind, value, check",
    [
        ("regex", r"[A-Z][a-z]{2,8} [0-9]{1,2}(am|pm)", lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,2}(am|pm)", t)),
        ("choice", ["Paris", "London", "Berlin", "Madrid"], lambda t: t in ("Paris", "London", "Berlin", "Madrid")),
        ("grammar", 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30}',
         lambda t: re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", t)),
    ],
)
def test_regex_choice_and_grammar_hold_on_50_samples(clean_real_llm, kind, value, check):
    prompt = chat_prompt(clean_real_llm, "Answer briefly: which city would you visit, and when?")
    so = StructuredOutputsParams(**{kind: value})
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured_outputs=so) for s in range(50)]
    outs = clean_real_llm.generate([prompt] * 50, params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


def test_logit_bias_and_allowed_ids(clean_real_llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=1)
    base = clean_real_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    banned = clean_real_llm.generate([prompt], greedy.clone(logit_bias={base: -100}), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != base
    target = clean_real_llm.engine.tokenizer.encode(" banana")[0]
    forced = clean_real_llm.generate([prompt], greedy.clone(logit_bias={target: 100}), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [target]
    allowed = clean_real_llm.engine.tokenizer.encode(" one two three four")
    out = clean_real_llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=16, allowed_token_ids=allowed), use_tqdm=False
    )[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)


def test_jump_forward_tokens_per_forward(clean_real_llm):
    """A schema with long fixed keys: most tokens are forced and cost no forward of their own."""
    keys = ["customer_account_identifier", "preferred_delivery_window", "requires_signature_on_delivery"]
    schema = {"type": "object", "properties": {k: {"type": "boolean"} for k in keys}, "required": keys,
              "additionalProperties": False}
    engine = clean_real_llm.engine
    engine.add_request("jf", chat_prompt(clean_real_llm, "Fill in the delivery form."),
                       SamplingParams(temperature=0, max_tokens=128, structured_outputs={"json": schema}))
    forwards = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        forwards += 1
    out = outs[0].outputs[0]
    assert list(json.loads(out.text)) == keys
    per_forward = len(out.token_ids) / (forwards - 1)  # the first forward is the prompt's
    print(f"jump-forward: {len(out.token_ids)} tokens in {forwards - 1} decode forwards = {per_forward:.2f}/forward")
    assert per_forward > 2
