"""Grammars against a real `tokenloom serve`: every hostile grammar shape is a 400 naming its limit,
through every field that carries a grammar, and after each the server is alive, /health says so and a
normal request (and a normal grammar) still works with nothing left running."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest_server import ServerProcess, metric, scrape, wait_for
from grammar_shapes import gbnf_chain, gbnf_wide, lark_chain, nested_any_of, nested_repeat_regex, ref_chain

pytestmark = pytest.mark.slow

C, CH = "/v1/completions", "/v1/chat/completions"
BASE = {"prompt": "Answer:", "max_tokens": 4, "temperature": 0}
MSG = [{"role": "user", "content": "Answer"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-model-len", "4096"])  # room for a tool schema in the system prompt
    yield srv
    srv.stop()


def _tool(params) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": params}}


# (route, body, what the 400's message must name)
HOSTILE = [
    (C, {**BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(1200)}}},
     "max_grammar_depth"),
    (C, {**BASE, "structured_outputs": {"grammar": lark_chain(3000)}}, "max_grammar_rules"),
    (C, {**BASE, "guided_grammar": lark_chain(800)}, "max_grammar_depth"),
    (C, {**BASE, "n": 20, "guided_grammar": gbnf_chain(1500)}, "max_grammar_depth"),
    (C, {**BASE, "guided_regex": nested_repeat_regex(2000, 1000, 1000)}, "max_grammar_"),
    (C, {**BASE, "guided_regex": nested_repeat_regex(900, 900)}, "max_grammar_"),
    (C, {**BASE, "guided_json": "[" * 100_000 + "]" * 100_000}, "max_grammar_depth"),
    (C, {**BASE, "guided_choice": [f"c{i}" for i in range(5000)]}, "max_grammar_rules"),
    # 450 nested anyOf nest the body itself past the server's JSON depth bound: refused before parsing.
    (CH, {"messages": MSG, "max_tokens": 4, "tools": [_tool(nested_any_of(450))], "tool_choice": "required"},
     "body: JSON nested"),
    (CH, {"messages": MSG, "max_tokens": 4, "tools": [_tool(ref_chain(200))], "tool_choice": "required"},
     "max_grammar_depth"),
    (C, {**BASE, "n": 64, "allowed_token_ids": list(range(49152)) * 6}, "allowed_token_ids"),
    (C, {**BASE, "n": 64, "bad_words": ["long bad word " * 70] * 1024}, "bad_words"),
]


def _still_serving(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = httpx.post(url + C, json={**BASE, "guided_choice": ["yes", "no"]}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    assert wait_for(lambda: metric(scrape(url), "tokenloom:num_requests_running") == 0, timeout=10)


@pytest.mark.parametrize("route,body,limit", HOSTILE, ids=[f"{i}-{lim}" for i, (_, _, lim) in enumerate(HOSTILE)])
def test_hostile_grammars_are_400s_naming_the_limit(server, route, body, limit):
    r = httpx.post(server.url + route, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=300)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and limit in err["message"], err
    assert server.proc.poll() is None
    _still_serving(server.url)


def test_large_accepted_grammars_run_with_many_sequences(server):
    """1,500 shallow GBNF rules with n=20 and 40,000 allowed ids with n=32: accepted and completed."""
    r = httpx.post(server.url + C, json={**BASE, "n": 20, "guided_grammar": gbnf_wide(1500), "max_tokens": 3,
                                        "temperature": 1.0, "seed": 1}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    assert all(c["text"].startswith("w") for c in r.json()["choices"])
    r = httpx.post(server.url + C, json={**BASE, "n": 32, "allowed_token_ids": list(range(40_000)), "max_tokens": 3,
                                        "bad_words": [f"word{i} " * 10 for i in range(100)]}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    _still_serving(server.url)
