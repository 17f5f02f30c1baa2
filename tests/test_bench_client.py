"""End-to-end load generator against a tiny fake OpenAI-compatible streaming server on 127.0.0.1.

The fake server streams one SSE message per token with short sleeps, then a usage-only message, then
[DONE]. Model names switch behaviours: "no-usage" (no usage message), "broken" (HTTP 500), "slow"
(sleeps long enough to hit the client's per-request timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenloom.bench.client import LoadConfig, run_load
from tokenloom.bench.datasets import SampleRequest, load_samples
from tokenloom.bench.serve_cli import add_bench_parser


def _count(prompt: str) -> int:
    return len(prompt.split()) + 1  # words + a BOS, so alignment has work to do


def make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(req: Request) -> dict:
        prompt = (await req.json())["prompt"]
        n = _count(prompt)
        return {"tokens": list(range(n)), "count": n}

    async def handle(req: Request, chat: bool):
        body = await req.json()
        state["bodies"].append(body)
        state["auth"].append(req.headers.get("authorization"))
        if body["model"] == "broken":
            return JSONResponse({"error": {"message": "nope"}}, status_code=500)
        n = body["max_tokens"]
        prompt_tokens = _count(body["messages"][0]["content"] if chat else body["prompt"])

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if body["model"] == "slow":
                    await asyncio.sleep(3)
                for i in range(n):
                    await asyncio.sleep(0.004)
                    piece = f" t{i}"
                    choice = (
                        {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    )
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if body["model"] != "no-usage":
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await handle(req, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    state: dict = {"bodies": [], "auth": [], "in_flight": 0, "max_in_flight": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def test_bench_serve_end_to_end(fake_server, tmp_path, capsys, monkeypatch):
    url, state = fake_server
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out = tmp_path / "result.json"
    args = bench_args(
        ["--base-url", url, "--num-prompts", "8", "--input-len", "12", "--output-len", "5",
         "--request-rate", "100", "--max-concurrency", "3", "--slo-ttft-ms", "5000", "--out", str(out),
         "--no-progress", "--seed", "1"]
    )  # fmt: skip
    returned = args.func(args)
    assert returned == 0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "Mean TTFT (ms):" in printed and "P99 ITL (ms):" in printed

    result = json.loads(out.read_text())
    assert result["model_id"] == "fake-model"  # from GET /v1/models
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 5  # from usage.completion_tokens
    assert result["output_lens"] == [5] * 8 and result["usage_reported"] is True
    assert result["input_lens"] == [12] * 8  # aligned through /tokenize, confirmed by usage
    assert result["total_input_tokens"] == 96
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "max_concurrent_requests", "config", "ttfts", "itls",
                "latencies", "start_times", "errors", "generated_texts"):  # fmt: skip
        assert key in result
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert result[f"{stat}_{name}_ms"] > 0
    assert all(len(gaps) == 4 for gaps in result["itls"])  # 5 messages -> 4 gaps
    assert all(0 < t < lat for t, lat in zip(result["ttfts"], result["latencies"], strict=True))
    assert result["errors"] == [""] * 8
    assert result["config"]["request_rate"] == 100 and "api_key" not in result["config"]
    assert 1 <= result["max_concurrent_requests"] <= 3
    assert state["max_in_flight"] <= 3  # --max-concurrency enforced

    body = state["bodies"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert state["auth"][-1] == "Bearer sk-test"


def test_chat_endpoint_and_usage_fallback(fake_server):
    url, _ = fake_server
    samples = [SampleRequest("hello there", 3, 4) for _ in range(3)]
    cfg = LoadConfig(base_url=url, model="no-usage", endpoint="chat", show_progress=False)
    results, duration = asyncio.run(run_load(cfg, samples))
    assert duration > 0
    assert all(r.success and not r.usage_reported for r in results)
    assert [r.output_tokens for r in results] == [4, 4, 4]  # counted non-empty text messages
    assert results[0].generated_text == " t0 t1 t2 t3"
    assert [r.prompt_len for r in results] == [3, 3, 3]  # no usage: the sample's estimate


def test_failures_are_counted_and_bounded(fake_server):
    url, _ = fake_server
    samples = load_samples("mixed", 4, input_len=5, output_len_dist="mixed:2,3", seed=0)
    assert sorted(s.max_tokens for s in samples) == [2, 2, 3, 3]
    broken = LoadConfig(base_url=url, model="broken", show_progress=False)
    results, _ = asyncio.run(run_load(broken, samples))
    assert not any(r.success for r in results) and all("HTTP 500" in r.error for r in results)

    slow = LoadConfig(base_url=url, model="slow", show_progress=False, request_timeout_s=0.3)
    t0 = time.monotonic()
    results, _ = asyncio.run(run_load(slow, samples[:2]))
    assert time.monotonic() - t0 < 2.5
    assert all(not r.success and "timed out" in r.error for r in results)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 7}\n\n{"prompt": "d e"}\n')
    samples = load_samples(str(path), 3, output_len=9)
    assert [(s.prompt, s.max_tokens) for s in samples] == [("a b c", 7), ("d e", 9), ("a b c", 7)]
    assert [s.max_tokens for s in load_samples(str(path), 2, output_len_dist="fixed:4")] == [4, 4]
    with pytest.raises(ValueError):
        load_samples(str(tmp_path / "missing.jsonl"), 2)
