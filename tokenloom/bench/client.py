"""Async load generator for OpenAI-compatible streaming endpoints (`/v1/completions`, `/v1/chat/completions`).

Each request is a streaming POST with ``stream_options: {"include_usage": true}``, ``temperature: 0`` and,
by default, ``ignore_eos: true`` (as `vllm bench serve` sends). Timing follows `metrics`:
start = perf_counter() just before the POST; TTFT = first SSE ``data:`` message with ``choices`` (text may
be empty); one ITL gap per later choice-bearing message; E2EL = last choice-bearing message. A request
succeeds if at least one choice-bearing message arrived and the stream ended without error.

Output tokens: ``usage.completion_tokens`` from the trailing usage message. Fallback when the server
sends no usage: the number of choice-bearing messages with non-empty text (exact for one token per
message; under-counts when a server bundles tokens); ``RequestResult.usage_reported`` tells which.
Input tokens: ``usage.prompt_tokens`` when reported, else the sample's (estimated) prompt_len.

Arrivals follow `arrivals.arrival_times`; ``max_concurrency`` caps in-flight requests with a semaphore
(start_time is taken after the semaphore, as in vLLM). Bounded: every request has a total timeout and
the whole run has a deadline, after which unfinished requests are cancelled and recorded as failed.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from .arrivals import arrival_times
from .datasets import SampleRequest
from .serving_metrics import RequestResult

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class LoadConfig:
    """What to send and how fast."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    run_timeout_s: float | None = None  # default: last arrival + request timeout + 60 s
    show_progress: bool = True


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def build_payload(cfg: LoadConfig, sample: SampleRequest) -> dict:
    body: dict = {
        "model": cfg.model,
        "temperature": 0.0,
        "max_tokens": sample.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.max_tokens
    elif cfg.endpoint == "completions":
        body["prompt"] = sample.prompt
    else:
        raise ValueError(f"unknown endpoint {cfg.endpoint!r}: use completions or chat")
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(sample.extra or {})
    return body


def _choice_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _stream_one(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict, chat: bool, result: RequestResult
) -> None:
    """Send one request and fill `result` in place (so a timeout keeps what was measured)."""
    start = time.perf_counter()
    result.start_time = start
    last = start
    got_choice = False
    chunks_with_text = 0
    text: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:500]
            result.error = f"HTTP {resp.status_code}: {detail}"
            return
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments, event:/id: fields
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            msg = json.loads(data)
            if msg.get("error"):
                result.error = f"stream error: {msg['error']}"
                return
            if choices := msg.get("choices"):
                if not got_choice:
                    got_choice = True
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                piece = _choice_text(choices[0], chat)
                if piece:
                    chunks_with_text += 1
                    text.append(piece)
            if usage := msg.get("usage"):
                if usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.usage_reported = True
                if usage.get("prompt_tokens") is not None:
                    result.prompt_len = int(usage["prompt_tokens"])
    if not got_choice:
        result.error = "Never received a valid chunk with choices"
        return
    result.latency = last - start
    result.generated_text = "".join(text)
    if not result.usage_reported:
        result.output_tokens = chunks_with_text
    result.success = True


async def send_request(
    client: httpx.AsyncClient, cfg: LoadConfig, sample: SampleRequest, headers: dict
) -> RequestResult:
    """One streaming request with a total timeout; errors become a failed RequestResult."""
    result = RequestResult(prompt_len=sample.prompt_len)
    url = cfg.base_url.rstrip("/") + ENDPOINT_PATHS[cfg.endpoint]
    try:
        await asyncio.wait_for(
            _stream_one(client, url, build_payload(cfg, sample), headers, cfg.endpoint == "chat", result),
            timeout=cfg.request_timeout_s,
        )
    except TimeoutError:
        result.success, result.error = False, f"timed out after {cfg.request_timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    return result


async def fetch_first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id listed by GET /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            resp = await client.get(url, headers=auth_headers(api_key))
            resp.raise_for_status()
            return resp.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"could not read a model id from {url}: {exc!r}; pass --model") from exc


def make_http_client(max_concurrency: int | None, request_timeout_s: float) -> httpx.AsyncClient:
    # No pool cap beyond --max-concurrency (httpx's default of 100 would queue requests silently).
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(request_timeout_s, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout)


async def run_load(cfg: LoadConfig, samples: Sequence[SampleRequest]) -> tuple[list[RequestResult], float]:
    """Send every sample on the arrival schedule; returns (results in sample order, duration in s)."""
    offsets = arrival_times(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    deadline_s = cfg.run_timeout_s
    if deadline_s is None:
        deadline_s = (offsets[-1] if offsets else 0.0) + cfg.request_timeout_s + 60.0
    headers = auth_headers(cfg.api_key)
    results = [
        RequestResult(prompt_len=s.prompt_len, error="not finished before the run deadline") for s in samples
    ]
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    pbar = tqdm(total=len(samples), disable=not cfg.show_progress, desc="requests")

    async with make_http_client(cfg.max_concurrency, cfg.request_timeout_s) as client:

        async def one(i: int) -> None:
            if sem is None:
                results[i] = await send_request(client, cfg, samples[i], headers)
            else:
                async with sem:
                    results[i] = await send_request(client, cfg, samples[i], headers)
            pbar.update(1)

        async def dispatch() -> None:
            tasks = []
            t0 = time.perf_counter()
            for i, offset in enumerate(offsets):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        start = time.perf_counter()
        try:
            await asyncio.wait_for(dispatch(), timeout=deadline_s)
        except TimeoutError:
            print(f"WARNING: run deadline of {deadline_s:.0f} s reached; unfinished requests count as failed")
        duration = time.perf_counter() - start
    pbar.close()
    return results, duration
