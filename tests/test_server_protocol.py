"""Fast server tests without the real model: protocol conversion, error mapping, and the app driven
in-process (httpx ASGITransport) over the tiny random-weight Llama, including a dying engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenloom import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM, EngineDeadError
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.metrics import EngineMetrics
from tokenloom.server import convert
from tokenloom.server.app import build_app
from tokenloom.server.errors import APIError, param_of
from tokenloom.server.protocol import ChatCompletionRequest, CompletionRequest


def test_param_of_names_the_field():
    assert param_of("temperature must be >= 0, got -1") == "temperature"
    assert param_of("prompt: 3000 tokens, but max_model_len is 2048") == "prompt"
    assert param_of("max_tokens: this model's maximum context length is 2048") == "max_tokens"
    assert param_of("something odd happened") is None


def test_completion_params_echo_logprobs_and_defaults():
    req = CompletionRequest(prompt="hi", echo=True, logprobs=3, stop="##", top_k=-1)
    p = convert.completion_params(req)
    assert p.prompt_logprobs == 3 and p.logprobs == 3 and p.stop == ["##"] and p.top_k == 0
    assert p.max_tokens == 16 and p.temperature == 1.0
    assert convert.completion_params(CompletionRequest(prompt="hi", logprobs=1)).prompt_logprobs is None


def test_chat_params_max_completion_tokens_wins_and_top_logprobs():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=50,
                                max_completion_tokens=7, logprobs=True, top_logprobs=4)
    p = convert.chat_params(req)
    assert p.max_tokens == 7 and p.logprobs == 4
    assert convert.chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])).logprobs is None
    with pytest.raises(APIError):
        convert.chat_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2))


def test_completion_prompt_forms():
    assert convert.completion_prompts("a") == ["a"]
    assert convert.completion_prompts(["a", "b"]) == ["a", "b"]
    assert convert.completion_prompts([1, 2]) == [[1, 2]]
    assert convert.completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(APIError):
        convert.completion_prompts([])


def test_chat_content_parts_are_flattened():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert convert.chat_messages(req)[0]["content"] == "ab"


def test_image_parts_are_refused_not_dropped():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "image_url"}]}])
    with pytest.raises(APIError, match=r"messages\[0\]\.content: 'image_url' parts are not supported"):
        convert.chat_messages(req)


def test_completion_logprobs_echo_first_token_null(tokenizer):
    lp = convert.CompletionLogprobs(tokenizer)
    ids = tokenizer.encode("Hello world")
    part = lp.part(ids, [None, {ids[1]: -1.5, 7: -0.5}])
    assert part["token_logprobs"] == [None, -1.5] and part["top_logprobs"][0] is None
    assert part["text_offset"] == [0, len("Hello")]


def run_app(engine, fn, **kwargs):
    """Run `fn(client)` against the app over `engine`, with the engine thread started and stopped."""

    async def main():
        metrics = EngineMetrics("tiny")
        async_llm = AsyncLLM(engine, metrics=metrics, num_threads=1)
        app = build_app(async_llm, "tiny", kwargs.get("api_key"), metrics=metrics,
                        max_request_body_bytes=kwargs.get("max_body", 1 << 20), shutdown_timeout=5)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await fn(client, async_llm)

    return asyncio.run(main())


def test_in_process_completion_chat_and_errors(make_engine):
    async def scenario(client: httpx.AsyncClient, async_llm: AsyncLLM):
        r = await client.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 3, "n": 2, "logprobs": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 3, "stream": True})
        assert r.text.rstrip().endswith("data: [DONE]") and '"role":"assistant"' in r.text
        r = await client.post("/v1/completions", json={"prompt": "x", "min_p": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p"
        r = await client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413
        r = await client.get("/metrics")
        assert "tokenloom:kv_cache_usage_perc" in r.text and "tokenloom:request_success_total" in r.text

    run_app(make_engine(), scenario, max_body=1000)


def test_auth_required_on_api_but_not_on_health(make_engine):
    async def scenario(client: httpx.AsyncClient, async_llm: AsyncLLM):
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200

    run_app(make_engine(), scenario, api_key="sekret")


def test_abort_frees_the_engine(make_engine):
    engine = make_engine()

    async def scenario(client: httpx.AsyncClient, async_llm: AsyncLLM):
        from tokenloom import SamplingParams

        stream = await async_llm.add("r1", "Once upon", SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        async_llm.abort("r1")
        async for _ in stream:  # ends once the abort went through
            pass
        assert stream.finished

    run_app(engine, scenario)  # make_engine's teardown checks that no request or KV block is left


def test_dead_engine_fails_streams_and_health(tiny_model, tokenizer):
    engine = LLMEngine(EngineConfig(max_model_len=1024, num_kv_blocks=64), model=tiny_model, tokenizer=tokenizer)

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.step = broken_step

    async def scenario(client: httpx.AsyncClient, async_llm: AsyncLLM):
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and "engine_dead" in r.text and r.text.rstrip().endswith("[DONE]")
        for _ in range(100):
            if not async_llm.is_healthy:
                break
            await asyncio.sleep(0.01)
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 503
        with pytest.raises(EngineDeadError):
            await async_llm.add("x", "Hi", None)

    run_app(engine, scenario)


def test_required_tool_schemas_keep_their_defs():
    """A pydantic-made tool schema ($defs + $ref) nested under the call array still resolves."""
    from tokenloom.server.structured import ToolChoice

    params = {"type": "object", "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}}},
              "properties": {"to": {"$ref": "#/$defs/Addr"}}}
    schema = json.loads(ToolChoice({"send": params}, None, parallel=False).grammar().json)
    assert schema["maxItems"] == 1 and "send.Addr" in schema["$defs"]
    assert "#/$defs/send.Addr" in json.dumps(schema["items"])
