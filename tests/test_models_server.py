"""Each architecture behind a real `tokenloom serve` on the fast path, with the `openai` SDK unchanged:
Qwen2.5-Coder-0.5B chats in its own ChatML template and stops at its end of turn, Gemma 3 270M (a base
model, no template) completes, structured output holds on both, and the start-up log's forward plan
names the architecture and its path."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest_server import ServerProcess

pytestmark = pytest.mark.slow

# Bounded, so that 64 tokens always hold a whole object (an unbounded integer let Gemma write digits past it).
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "gemma-3-270m"])
def served(request):
    server = ServerProcess([request.param, "--quantization", "auto"], startup_timeout=300)
    yield request.param, server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    server.stop()


def test_the_sdk_and_structured_output_run_unchanged(served):
    name, server, client = served
    assert [m.id for m in client.models.list().data] == [name]
    plan = next(line for line in server.log_text().splitlines() if "forward plan:" in line)
    arch = {"qwen2.5-coder-0.5b": "qwen2", "gemma-3-270m": "gemma3"}[name]
    assert f"forward plan: {arch};" in plan and "int4 x" in plan and "int8 grouped x" in plan, plan
    if name == "qwen2.5-coder-0.5b":
        assert "int5 x" in plan, plan  # its Q5_0 blocks straight into the int5 kernels
    assert "long prompts int" in plan, plan  # the same quantized weights: no bfloat16 copy kept
    done = client.completions.create(model=name, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    assert done.choices[0].text.strip() and done.usage.completion_tokens == 24
    person = client.completions.create(
        model=name, prompt="A person, as JSON:", max_tokens=64, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    assert person.choices[0].finish_reason == "stop", person.choices[0]
    jsonschema.validate(json.loads(person.choices[0].text), SCHEMA)
    stream = client.completions.create(model=name, prompt="The capital of France is", max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)


def test_chat_follows_the_models_template(served):
    name, _, client = served
    messages = [{"role": "user", "content": "Write a one-line Python comment saying hello."}]
    if name == "gemma-3-270m":  # a base model: no chat template, so chat is refused with a clear 400
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=name, messages=messages, max_tokens=8)
        return
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=96, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content.strip(), choice
    assert "<|im_end|>" not in choice.message.content and "<|im_start|>" not in choice.message.content
    shaped = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content), SCHEMA)
