"""Structured outputs and tool calls through a real server with real clients (the openai SDK, httpx):
response_format with a pydantic model (`chat.completions.parse`), forced tool calls streamed and not,
vLLM's structured_outputs / guided_* on completions, logit_bias, and 400s for what cannot work."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest_server import ServerProcess, metric, scrape
from pydantic import BaseModel
from test_server_api import assert_error, sse_payloads

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"],
    "additionalProperties": False}}}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--served-model-name", MODEL])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_sdk_parse_returns_a_parsed_pydantic_object(sdk):
    completion = sdk.chat.completions.parse(
        model=MODEL, messages=ask("Invent a person with a name and an age."), response_format=Person,
        max_tokens=64, temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_json_object_and_json_schema_on_completions(http):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Is water wet? Answer in JSON:",
                                               "max_tokens": 48, "temperature": 0, "response_format": fmt})
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["text"])
        assert isinstance(value, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(value, schema)


def test_vllm_structured_outputs_and_guided_fields(http):
    cases = [({"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}"}}, r"^[0-9]{4}-[0-9]{2}$"),
             ({"structured_outputs": {"choice": ["red", "blue"]}}, r"^(red|blue)$"),
             ({"guided_choice": ["up", "down"]}, r"^(up|down)$"),
             ({"guided_grammar": 'root ::= "a" ("b" | "c")'}, r"^a[bc]$")]
    import re

    for extra, pattern in cases:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Value:", "max_tokens": 16,
                                                   "temperature": 1.0, "seed": 4, "stream": stream, **extra})
            assert r.status_code == 200, r.text
            if stream:
                text = "".join(p["choices"][0]["text"] for p in sse_payloads(r.text)[:-1] if p["choices"])
            else:
                text = r.json()["choices"][0]["text"]
            assert re.fullmatch(pattern, text), (extra, text)


def test_required_tool_call_parses_in_the_sdk(sdk):
    completion = sdk.chat.completions.create(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=[WEATHER, TIME],
        tool_choice="required", max_tokens=96, temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        schema = (WEATHER if c.function.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), schema)


def test_named_tool_call_streamed_in_openai_delta_shape(sdk):
    stream = sdk.chat.completions.create(
        model=MODEL, messages=ask("Weather in Oslo, please."), tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96, temperature=0,
        stream=True,
    )
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            assert call.index == 0
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_choice_none_answers_as_text(sdk):
    completion = sdk.chat.completions.create(model=MODEL, messages=ask("Hi!"), tools=[WEATHER], tool_choice="none",
                                             max_tokens=8, temperature=0)
    assert completion.choices[0].message.tool_calls is None and completion.choices[0].message.content


def test_logit_bias_forces_a_token(http, server):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                           "logit_bias": {"1234": 100}})
    assert r.status_code == 200, r.text
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": r.json()["choices"][0]["text"]}).json()
    assert tokens["tokens"] == [1234, 1234, 1234]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"prompt": "x", "structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"prompt": "x", "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
         "structured_outputs.json"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"prompt": "x", "logit_bias": {"60000": 5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ({"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"messages": ask("hi"), "tools": [WEATHER]}, "tool_choice"),
        ({"messages": ask("hi"), "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": ask("hi"), "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content"),
        ({"messages": ask("hi"), "functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_cannot_work_is_a_400_naming_it(http, server, body, param):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(http.post(route, json={"model": MODEL, "max_tokens": 4, **body}), 400, param)
    assert metric(scrape(server.url), "tokenloom:num_requests_running") == 0
