"""Structured outputs: parameters, grammar compilation and its cache, bitmasks (no model needed)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.structured_output.grammar import GrammarCompiler, bitmask_words, unpack_bitmask

SCHEMAS = os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")
VOCAB = 49152


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def allowed(state) -> torch.Tensor:
    mask = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    state.fill_bitmask(mask[0])
    return unpack_bitmask(mask, VOCAB)[0]


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="structured_outputs: set exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs: set exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs: unknown field"):
        StructuredOutputsParams.from_dict({"jsn": {}})


def test_same_schema_as_object_or_text_compiles_once(compiler):
    a = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    before = compiler.num_compiled
    compiler.matcher(StructuredOutputsParams(json=a))
    compiler.matcher(StructuredOutputsParams(json=json.dumps(a, indent=2)))
    assert compiler.num_compiled == before + 1


def test_properties_come_in_the_schema_order(compiler, tokenizer):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    assert tokenizer.decode(state.forced_tokens()).startswith('{"zeta')


@pytest.mark.parametrize(
    "params, field",
    [
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["ok", 3]}, "structured_outputs.choice"),
    ],
)
def test_invalid_grammars_name_the_field(compiler, params, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        compiler.compile(StructuredOutputsParams(**params))


def test_choice_masks_and_forces(compiler, tokenizer):
    state = compiler.matcher(StructuredOutputsParams(choice=["positive", "negative"]))
    first = allowed(state)
    texts = {tokenizer.id_to_token(t) for t in first.nonzero().flatten().tolist()}
    assert texts and all("positive".startswith(t) or "negative".startswith(t) for t in texts)
    for token in tokenizer.encode("negative"):
        assert state.accept(token)
    # The grammar is complete: only an end-of-sequence token is allowed now.
    assert set(allowed(state).nonzero().flatten().tolist()) <= set(tokenizer.eos_token_ids)


def test_json_keys_are_forced(compiler, tokenizer):
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"}},
              "required": ["temperature_celsius"], "additionalProperties": False}
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    forced = tokenizer.decode(state.forced_tokens())
    assert forced.startswith('{"temperature_celsius'), forced  # the closing quote may merge with ':'


def test_every_acceptance_schema_compiles(compiler):
    with open(SCHEMAS) as f:
        schemas = json.load(f)
    assert len(schemas) >= 20
    for schema in schemas.values():
        compiler.compile(StructuredOutputsParams(json=schema))
