"""Cascades (issue 55) in one real `tokenloom serve`: the bundled SmolLM2 as the small tier and
Qwen2.5-Coder-0.5B as the large one (two tokenizers, two chat templates), plus a model whose file is
broken. Threshold 1.0 forces escalation, 0.0 forbids it, so the exactness checks do not depend on
where a calibrated threshold falls: greedy, an escalated request's text is the large model's own answer
and an answered-small one the small model's own; streamed and non-streamed agree; structured output and a
forced tool call through a cascade validate; usage adds up over the tiers; a tier that cannot load
leaves the cascade answering from the one it has, saying so."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from conftest_server import ServerProcess, metric, scrape

from tokenloom.model.loader import bundled_model_path
from tokenloom.server.cascade_config import CascadeRule, write_config
from tokenloom.server.cascade_signals import LogisticProbe

pytestmark = pytest.mark.slow

SMOL = bundled_model_path()
CHAT = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
PROMPT = "def is_even(n):\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                       "required": ["city"], "additionalProperties": False}}}


SMOL_HIDDEN = 576  # SmolLM2-135M's hidden size: the probe's features


def probe_file(path, bias: float) -> str:
    """A calibration whose probe ignores its features: p(fail) = sigmoid(bias) for every prompt."""
    zeros = np.zeros(SMOL_HIDDEN)
    write_config(str(path), [SMOL, "qwen2.5-coder-0.5b"],
                 CascadeRule(signal="probe", threshold=0.5, probe=LogisticProbe(zeros, bias, zeros, zeros + 1)), {})
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    broken = tmp_path_factory.mktemp("models") / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    route_up = probe_file(broken.parent / "route-up.json", 5.0)
    route_stay = probe_file(broken.parent / "route-stay.json", -5.0)
    # A tier of its own short context, and a cascade from the preset file (after the command line's).
    preset = broken.parent / "models.toml"
    preset.write_text(f'[short]\nsource = "{SMOL}"\nmax_model_len = 64\n'
                      '[fits]\ntiers = ["short", "qwen"]\nthreshold = 0\n')
    proc = ServerProcess([f"smol={SMOL}", "qwen=qwen2.5-coder-0.5b", f"bad={broken}", f"bad2={broken}",
                          "--models-preset", str(preset),
                          "--cascade", "up=smol,qwen;threshold=1.0",
                          "--cascade", "stay=smol,qwen;threshold=0.0",
                          "--cascade", "auto=smol,qwen",
                          "--cascade", "budget=smol,qwen;k=4;threshold=0;target_escalation=0.5",
                          "--cascade", "tobad=smol,bad;threshold=1.0",
                          "--cascade", "frombad=bad,qwen",
                          "--cascade", "nobody=bad,bad2",
                          "--cascade", f"router=smol,qwen;config={route_up}",
                          "--cascade", f"routerstay=smol,qwen;config={route_stay}"])
    yield proc
    proc.stop()


def chat(http: httpx.Client, model: str, **extra) -> dict:
    r = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 24,
                                                "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def complete(http: httpx.Client, model: str, **extra) -> dict:
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                           **extra})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http: httpx.Client, path: str, body: dict) -> tuple[str, list[dict]]:
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join((c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                   for c in chunks if c["choices"])
    return text, chunks


def test_escalated_equals_the_large_model_and_usage_adds_up(server):
    with server.client() as http:
        own = chat(http, "qwen")
        small = chat(http, "smol")
        out = chat(http, "up")
        assert out["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
        assert out["choices"][0]["message"]["content"] != small["choices"][0]["message"]["content"]
        assert (out["model"], out["served_by"], out["escalated"]) == ("up", "qwen", True)
        assert 0 <= out["confidence"] <= 1
        tiers = out["usage"]["tiers"]
        assert [t["model"] for t in tiers] == ["smol", "qwen"]
        assert tiers[0]["prompt_tokens"] == small["usage"]["prompt_tokens"]
        assert 16 <= tiers[0]["completion_tokens"] <= 24  # held k = 16 tokens (a few more may race the abort)
        assert tiers[1]["prompt_tokens"] == own["usage"]["prompt_tokens"]  # its own template and tokenizer
        assert tiers[1]["completion_tokens"] == own["usage"]["completion_tokens"]
        assert out["usage"]["total_tokens"] == sum(t["prompt_tokens"] + t["completion_tokens"] for t in tiers)
        c_own, c_out = complete(http, "qwen"), complete(http, "up")
        assert c_out["choices"][0]["text"] == c_own["choices"][0]["text"] and c_out["served_by"] == "qwen"


def test_answered_small_equals_the_small_model(server):
    with server.client() as http:
        own, out = chat(http, "smol"), chat(http, "stay")
        assert out["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
        assert (out["served_by"], out["escalated"]) == ("smol", False)
        assert out["usage"]["tiers"] == [{"model": "smol", **{k: own["usage"][k] for k in
                                                              ("prompt_tokens", "completion_tokens")}}]
        assert "logprobs" not in json.dumps(out["choices"][0]["message"]) and out["choices"][0]["logprobs"] is None
        c_own, c_out = complete(http, "smol"), complete(http, "stay")
        assert c_out["choices"][0]["text"] == c_own["choices"][0]["text"]


def test_client_logprobs_are_its_own(server):
    """The cascade asks the small tier for 20 logprobs; the client sees the 2 it asked for, as the model's own."""
    with server.client() as http:
        own = chat(http, "smol", logprobs=True, top_logprobs=2)
        out = chat(http, "stay", logprobs=True, top_logprobs=2)
        assert out["choices"][0]["logprobs"] == own["choices"][0]["logprobs"]
        assert all(len(t["top_logprobs"]) == 2 for t in out["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("model", ["up", "stay"])
def test_streamed_equals_non_streamed(server, model):
    with server.client() as http:
        whole = chat(http, model)
        text, chunks = streamed(http, "/v1/chat/completions",
                                {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0})
        assert text == whole["choices"][0]["message"]["content"]
        last = chunks[-1]
        assert (last["served_by"], last["escalated"]) == (whole["served_by"], whole["escalated"])
        assert last["usage"]["tiers"][-1] == whole["usage"]["tiers"][-1]
        assert all("served_by" not in c for c in chunks[:-1])
        ctext, _ = streamed(http, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 20,
                                                      "temperature": 0})
        assert ctext == complete(http, model)["choices"][0]["text"]


@pytest.mark.parametrize("model", ["up", "stay"])
def test_structured_output_and_tool_call_validate(server, model):
    with server.client() as http:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        out = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 48, "temperature": 0, "response_format": fmt,
            "messages": [{"role": "user", "content": "Give a person as JSON."}]}).json()
        person = json.loads(out["choices"][0]["message"]["content"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
        assert out["served_by"] == ("qwen" if model == "up" else "smol")
        call = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 40, "temperature": 0, "tools": [TOOL], "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}).json()
        calls = call["choices"][0]["message"]["tool_calls"]
        assert call["choices"][0]["finish_reason"] == "tool_calls"
        assert calls[0]["function"]["name"] == "get_weather"
        assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)


def test_default_rule_decides_by_its_threshold(server):
    with server.client() as http:
        out = chat(http, "auto")
        assert out["escalated"] == (out["confidence"] < 0.8)
        assert out["served_by"] == ("qwen" if out["escalated"] else "smol")
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert listed["auto"]["cascade"] == {"tiers": ["smol", "qwen"], "k": 16, "signal": "p10_top1",
                                             "threshold": 0.8}


def test_a_target_escalation_sends_on_the_share_asked_of_the_traffic_served(server):
    from tokenloom.server.cascade_config import BUDGET_MIN

    seen, escalated = [], []
    with server.client() as http:
        for i in range(BUDGET_MIN + 12):
            r = http.post("/v1/completions", json={"model": "budget", "prompt": f"{i} times {i + 3} is",
                                                   "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            out = r.json()
            if len(seen) >= BUDGET_MIN:  # the running threshold: the median of the confidences so far
                median = sorted(seen)[round(0.5 * len(seen))]
                assert out["escalated"] == (out["confidence"] < median), (i, out["confidence"], median)
            else:  # until then the fixed threshold, 0: never
                assert not out["escalated"]
            seen.append(out["confidence"])
            escalated.append(out["escalated"])
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}["budget"]["cascade"]
    assert listed["target_escalation"] == 0.5
    assert listed["threshold"] == pytest.approx(sorted(seen)[round(0.5 * len(seen))], abs=1e-4)
    assert 0 < sum(escalated[BUDGET_MIN:]) < len(escalated) - BUDGET_MIN


def test_a_tier_that_cannot_load_is_skipped_and_named(server):
    with server.client() as http:
        out = chat(http, "tobad")  # threshold 1.0 wants the next tier; it failed to load: smol's answer stands
        assert (out["served_by"], out["escalated"]) == ("smol", False)
        assert out["skipped"][0]["model"] == "bad" and "failed to load" in out["skipped"][0]["reason"]
        assert out["choices"][0]["message"]["content"] == chat(http, "smol")["choices"][0]["message"]["content"]
        first = chat(http, "frombad")
        assert (first["served_by"], first["skipped"][0]["model"]) == ("qwen", "bad")
        r = http.post("/v1/chat/completions", json={"model": "nobody", "messages": CHAT, "max_tokens": 4})
        assert r.status_code == 503 and "model `bad2` failed to load" in r.json()["error"]["message"], r.text


def test_a_tier_that_cannot_serve_the_request_is_skipped_by_rule(server):
    """`short` holds 64 tokens: a longer prompt is past its context, so the next tier answers it."""
    long_prompt = "Count the apples: " + "one apple, " * 40
    with server.client() as http:
        before = scrape(server.url)
        r = http.post("/v1/completions", json={"model": "fits", "prompt": long_prompt, "max_tokens": 8,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["served_by"], out["escalated"]) == ("qwen", True)
        assert out["skipped"][0]["model"] == "short" and "64" in out["skipped"][0]["reason"], out["skipped"]
        own = http.post("/v1/completions", json={"model": "qwen", "prompt": long_prompt, "max_tokens": 8,
                                                 "temperature": 0}).json()
        assert out["choices"][0]["text"] == own["choices"][0]["text"]
        short = http.post("/v1/completions", json={"model": "fits", "prompt": PROMPT, "max_tokens": 8}).json()
        assert (short["served_by"], short["escalated"]) == ("short", False)  # threshold 0: it stands
        after = scrape(server.url)
    labels = {"cascade": "fits", "tier": "short", "reason": "tier_cannot_serve"}
    assert metric(after, "tokenloom:cascade_escalations_total", **labels) - metric(
        before, "tokenloom:cascade_escalations_total", **labels) == 1


def test_bad_requests_are_4xx_in_openai_shape(server):
    with server.client() as http:
        for body, param in (({"n": 2}, "n"), ({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt")):
            r = http.post("/v1/completions", json={"model": "stay", "prompt": "x", "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post("/tokenize", json={"model": "stay", "prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = http.post("/v1/completions", json={"model": "stay", "prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and "max_tokens" in r.text


def test_metrics_count_requests_escalations_and_tokens(server):
    with server.client() as http:
        before = scrape(server.url)
        chat(http, "up")
        chat(http, "stay")
        after = scrape(server.url)

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("tokenloom:cascade_requests_total", cascade="up") == 1
    assert grew("tokenloom:cascade_escalations_total", cascade="up", tier="smol", reason="low_confidence") == 1
    assert grew("tokenloom:cascade_answered_total", cascade="up", tier="qwen") == 1
    assert grew("tokenloom:cascade_answered_total", cascade="stay", tier="smol") == 1
    assert grew("tokenloom:cascade_escalations_total", cascade="stay") == 0
    assert grew("tokenloom:cascade_tokens_total", cascade="up", tier="smol", kind="completion") >= 16
    assert grew("tokenloom:cascade_tokens_total", cascade="up", tier="qwen", kind="completion") > 0
    assert "cascade up: answered by qwen (escalated; smol: p10_top1 " in server.log_text()
    assert "cascade stay: answered by smol (first tier; smol: p10_top1 " in server.log_text()


def test_the_prompt_only_probe_routes_before_the_small_model_writes(server):
    """A probe over the prompt's pooled hidden state decides once the prompt ran: one small token held."""
    with server.client() as http:
        up = chat(http, "router")
        assert (up["served_by"], up["escalated"]) == ("qwen", True)
        assert up["confidence_signals"]["probe"] == pytest.approx(1 - 1 / (1 + np.exp(-5.0)), abs=1e-4)
        assert 1 <= up["usage"]["tiers"][0]["completion_tokens"] <= 3  # decided after the prompt, not k = 16
        assert up["choices"][0]["message"]["content"] == chat(http, "qwen")["choices"][0]["message"]["content"]
        stay = chat(http, "routerstay")
        assert (stay["served_by"], stay["escalated"]) == ("smol", False)
        assert stay["choices"][0]["message"]["content"] == chat(http, "smol")["choices"][0]["message"]["content"]
