"""Llama 3.x's tool calls (`{"name": ..., "parameters": ...}` objects, server/tool_parser_json.py): the
whole-output parse, the stream (content live, a possible call held to the end, the same message as the
non-streamed response), the work per token, and "auto" end to end through the app on a chat template
that asks for them, the model's text forced by a regex (real tokens, detokenized deltas, SSE)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenloom import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.metrics import EngineMetrics
from tokenloom.model.tokenizer import TokenizerWrapper
from tokenloom.server.app import build_app
from tokenloom.server.structured import tool_choice
from tokenloom.server.tool_parser_json import PYTHON_TAG, StreamingJSONCallParser, parse_json_calls
from tokenloom.server.tool_template import HERMES, LLAMA3_JSON, call_format

# A chat template in Llama 3.x's manner (our words): tools listed in the first user turn, calls asked
# for as {"name", "parameters"} objects.
LLAMA_STYLE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if loop.first and tools %}Call a function by answering {\"name\": function name, \"parameters\": "
    "its arguments}. Functions: {% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(("text", "calls"), [
    (CALL, [("get_weather", {"city": "Paris"})]),
    ("  \n" + PYTHON_TAG + CALL, [("get_weather", {"city": "Paris"})]),
    ('{"name": "f", "arguments": {"x": [1, {"y": "}"}]}}', [("f", {"x": [1, {"y": "}"}]})]),
    (CALL + "; " + '{"name": "g", "parameters": {}}', [("get_weather", {"city": "Paris"}), ("g", {})]),
    (CALL + "\n" + '{"name": "g"}', [("get_weather", {"city": "Paris"}), ("g", {})]),
])
def test_whole_outputs_that_are_calls(text, calls):
    parsed = parse_json_calls(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize("text", [
    "The weather is fine.", '{"answer": 42}', '{"name": "", "parameters": {}}', '{"name": "f", "parameters": [1]}',
    CALL + " and then some words", CALL[:-1], '{"name": 3, "parameters": {}}', "", "   ", "Here: " + CALL,
    CALL + ";;" + CALL, "[" + CALL + "]",
])
def test_anything_else_is_content_as_written(text):
    parsed = parse_json_calls(text)
    assert parsed.calls == [] and parsed.content == text


def stream(text: str, size: int) -> tuple[dict, StreamingJSONCallParser]:
    """`text` fed `size` characters at a time: the deltas merged as a client accumulates them."""
    parser = StreamingJSONCallParser()
    content, calls = [], {}
    chunks = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, chunk in enumerate(chunks):
        delta = parser.feed(chunk, final=i == len(chunks) - 1)
        content.append(delta.get("content") or "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
            assert call["id"].startswith("call_") and call["type"] == "function"
    return {"content": "".join(content) or None, "calls": [calls[i] for i in sorted(calls)]}, parser


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("text", [CALL, PYTHON_TAG + CALL, " " + CALL + ";" + CALL, "Plain words, no call.",
                                  '{"answer": 42}', CALL + " trailing", "<|py", "<|python_tag|>hello", "\n\n"])
def test_the_stream_gives_the_non_streamed_message(text, size):
    got, parser = stream(text, size)
    whole = parse_json_calls(text)
    assert got["content"] == (whole.content or None)
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [(c.name, c.arguments) for c in whole.calls]
    assert parser.called == bool(whole.calls)


def test_content_streams_live_and_the_work_per_token_is_the_token():
    parser = StreamingJSONCallParser()
    assert parser.feed("Hello") == {"content": "Hello"}  # no hold-back once the text cannot be a call
    parser = StreamingJSONCallParser()
    argument = "x" * 100_000
    parser.feed('{"name": "f", "parameters": {"a": "')
    before = parser.scanned
    for ch in argument:
        assert parser.feed(ch) == {}
    assert parser.scanned - before == len(argument)  # one character examined per one-character token
    delta = parser.feed('"}}', final=True)
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"a": argument}


def test_llama_style_templates_are_read_as_json_calls_and_auto_accepted():
    from tokenloom.server.protocol import ChatCompletionRequest

    assert call_format(LLAMA_STYLE) == LLAMA3_JSON
    assert call_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert call_format("{% if tools %}{{ tools }}{% endif %}") is None
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    choice = tool_choice(req, LLAMA_STYLE)
    assert choice.auto and choice.call_format == LLAMA3_JSON


def run_app(engine, fn):
    async def main():
        metrics = EngineMetrics("tiny")
        async_llm = AsyncLLM(engine, metrics=metrics, num_threads=1)
        app = build_app(async_llm, "tiny", metrics=metrics, shutdown_timeout=5)
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                       base_url="http://test") as client:
            return await fn(client)

    return asyncio.run(main())


def test_auto_on_a_llama_style_template_end_to_end(tiny_model, tokenizer):
    wrapper = TokenizerWrapper(tokenizer.tokenizer, tokenizer.eos_token_ids, tokenizer.bos_token_id, LLAMA_STYLE)
    engine = LLMEngine(EngineConfig(max_model_len=1024, num_kv_blocks=256), model=tiny_model, tokenizer=wrapper)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 64,
            "temperature": 0, "structured_outputs": {"regex": r'\{"name": "get_weather", "parameters": \{"city": '
                                                             r'"(Paris|Rome)"\}\}'}}

    async def scenario(client: httpx.AsyncClient):
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None, whole
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        streamed = [t for d in deltas for t in d.get("tool_calls") or []]
        assert [t["function"]["arguments"] for t in streamed] == [call["function"]["arguments"]]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        text = (await client.post("/v1/chat/completions", json={**body, "structured_outputs": {
            "regex": "It is sunny"}})).json()["choices"][0]
        assert text["message"]["content"] == "It is sunny" and "tool_calls" not in text["message"]

    run_app(engine, scenario)
