"""End-to-end: a real `tokenloom serve` process on the bundled model, driven by httpx and the openai SDK.

One server for the whole module (loading takes ~10 s). Greedy outputs are compared with the offline
`LLM` (the session's `real_llm`) at temperature 0 and the same max_tokens.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest_server import ServerProcess, metric, scrape, wait_for

from tokenloom import SamplingParams

pytestmark = pytest.mark.slow

API_KEY = "test-key"
METRICS_TOKEN = "scrape-only"
MODEL = "tl-test"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--served-model-name", MODEL, "--max-request-body-bytes", "65536"], api_key=API_KEY,
                        metrics_token=METRICS_TOKEN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(real_llm):
    """Greedy offline outputs for PROMPTS (max_tokens 12), the reference for server outputs."""
    outs = real_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an SSE body, '[DONE]' kept as a string."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


# -- discovery ------------------------------------------------------------------------------------


def test_health_version_models_openapi(server, http):
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = schema["paths"][path]["post"]
        assert "application/json" in op["requestBody"]["content"]
        assert "text/event-stream" in op["responses"]["200"]["content"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "stream", "logprobs", "echo", "top_k"} <= set(props)


# -- completions ----------------------------------------------------------------------------------


def test_completion_greedy_matches_offline(http, offline):
    prompt = PROMPTS[0]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["text"] == offline[prompt]
    assert choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 12 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completion_stream_sdk_matches_non_stream(sdk, http, offline):
    prompt = PROMPTS[1]
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline[prompt]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12
    # Raw wire format: text/event-stream, `data:` lines, ending with [DONE].
    with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.read().decode())
    assert payloads[-1] == "[DONE]" and all(isinstance(p, dict) for p in payloads[:-1])


def test_completion_n2_seeded_and_prompt_forms(http, server):
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "n": 2, "temperature": 0.9, "seed": 7}
    r1, r2 = http.post("/v1/completions", json=body).json(), http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r1["choices"]] == [0, 1]
    assert [c["text"] for c in r1["choices"]] == [c["text"] for c in r2["choices"]]  # seeded = reproducible
    assert r1["usage"]["completion_tokens"] <= 12
    # Token ids and lists of prompts give the same greedy text as the string prompt.
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    greedy = {"max_tokens": 5, "temperature": 0}
    by_text = http.post("/v1/completions", json={"prompt": PROMPTS[0], **greedy}).json()["choices"][0]["text"]
    by_ids = http.post("/v1/completions", json={"prompt": ids, **greedy}).json()["choices"][0]["text"]
    many = http.post("/v1/completions", json={"prompt": [PROMPTS[0], PROMPTS[3]], "n": 2, **greedy}).json()
    nested = http.post("/v1/completions", json={"prompt": [ids, ids], **greedy}).json()
    assert by_ids == by_text
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == by_text and many["choices"][1]["text"] == by_text
    assert [c["text"] for c in nested["choices"]] == [by_text, by_text]


def test_logprobs_and_echo(http):
    prompt = PROMPTS[3]
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and 2 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert top[tok] == value
    # lm-evaluation-harness loglikelihood: echo + logprobs + max_tokens 1.
    r = http.post("/v1/completions",
                  json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 1
    assert "".join(lp["tokens"][: len(ids)]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(prompt)
    # Streaming echo sends the prompt first.
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True, "stream": True})
    assert sse_payloads(r.text)[0]["choices"][0]["text"].startswith(prompt)


def test_stop_strings(http, offline):
    prompt = PROMPTS[2]
    full = offline[prompt]
    words = full.split()
    stop = " " + words[len(words) // 2]  # a stop string in the middle of the greedy text
    expected = full[: full.index(stop)]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop, "@@never@@"]}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == expected and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    streamed = sse_payloads(http.post("/v1/completions", json={**body, "stream": True}).text)
    chunks = [p["choices"][0] for p in streamed if p != "[DONE]" and p["choices"]]
    assert "".join(c["text"] for c in chunks) == expected and chunks[-1]["finish_reason"] == "stop"


def test_vllm_extras_and_unknown_fields(http):
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.7, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 8, "priority": 1,
            "stop_token_ids": [2], "seed": 1, "some_future_field": {"x": 1}, "best_of": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                   "top_k": 5, "ignore_eos": True, "whatever": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4


# -- chat -----------------------------------------------------------------------------------------


def test_chat_matches_offline_and_streams(sdk, real_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = real_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    resp = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.outputs[0].text
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids) <= 12
    assert choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.outputs[0].text
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_n2_and_max_tokens(http):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}],
            "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 3}
    r = http.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] <= 10


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


# -- errors ---------------------------------------------------------------------------------------


def test_errors_have_openai_shape_and_server_keeps_serving(server, http):
    cases = [
        ({"prompt": "x", "temperature": -1}, 400, "temperature", None),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", None),
        ({"prompt": "x", "n": 0}, 400, "n", None),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
        ({"prompt": "x", "stream": "yes"}, 400, "stream", None),
        ({"prompt": 5}, 400, "prompt", None),
        ({"prompt": []}, 400, "prompt", None),
        ({"max_tokens": 3}, 400, "prompt", None),
        ({"prompt": [10**9]}, 400, "prompt", None),  # the request field, not the engine's name
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ]
    for body, status, param, code in cases:
        assert_error(http.post("/v1/completions", json=body), status, param, code)
    # Prompt too long: the message names both numbers.
    long_prompt = "hello " * 2100
    err = assert_error(http.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert "2048" in err["message"] and any(str(n) in err["message"] for n in range(2049, 2300))
    err = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}), 400, "max_tokens")
    assert "2048" in err["message"] and "5000" in err["message"]
    # Chat-specific.
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400)
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": 0}), 400, "max_tokens")
    # Not JSON at all.
    assert_error(http.post("/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"}), 400)
    # Body too large (this server allows 64 KiB).
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 70000}), 413, code="request_too_large")
    # Auth: no key, wrong key -> 401; health stays open; /metrics takes only the scrape token.
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert_error(httpx.get(f"{server.url}/metrics"), 401)
    assert_error(http.get("/metrics"), 401)  # the API key does not open it when a scrape token exists
    assert httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).status_code == 200
    # Unknown route: OpenAI shape too.
    assert_error(http.get("/v1/nothing"), 404)
    # Still serving.
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


# -- load, metrics, disconnects -------------------------------------------------------------------


def test_32_concurrent_streams_and_metrics(server, offline):
    before = scrape(server.url)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = await r.aread()
        payloads = sse_payloads(text.decode())
        assert payloads[-1] == "[DONE]"
        return prompt, "".join(p["choices"][0]["text"] for p in payloads[:-1] if p["choices"])

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=180, limits=limits) as c:
            return await asyncio.gather(*(one(c, PROMPTS[i % len(PROMPTS)]) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text in results:
        assert text == offline[prompt]
    after = scrape(server.url)

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("tokenloom:request_success_total") >= 32
    assert moved("tokenloom:generation_tokens_total") >= 32
    assert moved("tokenloom:prompt_tokens_total") >= 32 * 4
    assert moved("tokenloom:time_to_first_token_seconds_count") >= 32
    assert moved("tokenloom:e2e_request_latency_seconds_count") >= 32
    assert moved("tokenloom:inter_token_latency_seconds_count") >= 32
    assert moved("tokenloom:iteration_tokens_total_count") >= 1
    assert moved("tokenloom:prefix_cache_queries_total") > 0
    assert metric(after, "tokenloom:iteration_num_seqs_bucket", le="1.0") < metric(
        after, "tokenloom:iteration_num_seqs_count")  # some steps batched several sequences
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"tokenloom:{name}") == 0


def test_disconnects_abort_and_free_kv(server):
    before = scrape(server.url)

    async def drop_after_two_chunks(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
            await asyncio.gather(*(drop_after_two_chunks(c, i) for i in range(8)))

    asyncio.run(run_all())
    # A non-streaming client that gives up (read timeout) is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=1.5,
                   json={"prompt": "A long essay:", "max_tokens": 1000, "ignore_eos": True})

    def idle():
        s = scrape(server.url)
        return s if metric(s, "tokenloom:kv_cache_usage_perc") == 0 and metric(
            s, "tokenloom:num_requests_running") == 0 else None

    after = wait_for(idle, timeout=20)
    assert after, f"KV cache not freed after disconnects: {scrape(server.url)}"
    aborted = metric(after, "tokenloom:request_success_total", finished_reason="abort") - metric(
        before, "tokenloom:request_success_total", finished_reason="abort")
    assert aborted == 9
    # 9 x (400 or 1000) tokens were asked for; far fewer were generated before the aborts.
    assert metric(after, "tokenloom:generation_tokens_total") - metric(
        before, "tokenloom:generation_tokens_total") < 9 * 200


def test_lora_routes_refused_unless_enabled(server, http):
    """Without --enable-lora the adapter routes answer 400 naming it; without the key, 401 first."""
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        r = http.post(route, json=body)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        assert httpx.post(f"{server.url}{route}", json=body).status_code == 401
