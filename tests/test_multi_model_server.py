"""Several models behind one real `tokenloom serve` (issue 54): the bundled SmolLM2 under two names from
one file. Each name's greedy output equals the single-model server's, concurrent requests to both
complete, load / unload / status and autoload work, an unknown model is a 404, a budget that holds one
model evicts the least recently used, and a model over the whole budget is refused at start."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from conftest_server import BASE_ARGS, ServerProcess, metric, scrape

from tokenloom.model import catalog
from tokenloom.model.loader import bundled_model_path

pytestmark = pytest.mark.slow

MODEL = bundled_model_path()
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colours."}]


def greedy(http: httpx.Client, model: str | None) -> list[str]:
    body = {"max_tokens": 16, "temperature": 0, **({"model": model} if model else {})}
    texts = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in PROMPTS]
    chat = http.post("/v1/chat/completions", json={**body, "messages": CHAT}).json()
    return [*texts, chat["choices"][0]["message"]["content"]]


@pytest.fixture(scope="module")
def single_outputs():
    server = ServerProcess([MODEL])
    try:
        with server.client() as http:
            yield greedy(http, None)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    garbage = tmp_path_factory.mktemp("models") / "broken.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    server = ServerProcess([f"a={MODEL}", f"b={MODEL}", f"bad={garbage}"], api_key="k")
    yield server
    server.stop()


def statuses(http: httpx.Client, path: str = "/v1/models") -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in http.get(path).json()["data"]}


def test_each_model_answers_as_its_own_server(multi, single_outputs):
    with multi.client() as http:
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["a", "b", "bad"]
        assert all(m["status"] == {"value": "loaded"} and m["resident_bytes"] > 0 for m in models[:2])
        bad = models[2]  # a model that fails to load is `failed` with its reason; the others serve
        assert bad["status"]["value"] == "failed" and bad["status"]["reason"] and bad["resident_bytes"] == 0
        r = http.post("/v1/completions", json={"model": "bad", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", r.text
        assert http.get("/models").json()["data"][0]["id"] == "a"
        assert greedy(http, "a") == single_outputs
        assert greedy(http, "b") == single_outputs
        r = http.post("/v1/completions", json={"model": "b", "prompt": PROMPTS[0], "max_tokens": 16,
                                               "temperature": 0, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        tok = http.post("/tokenize", json={"model": "b", "prompt": PROMPTS[0]}).json()
        assert http.post("/detokenize", json={"model": "a", "tokens": tok["tokens"]}).json()["prompt"].endswith(
            PROMPTS[0])
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT}),
                           ("/tokenize", {"prompt": "x"})):
            r = http.post(path, json={**body, "model": "nope", "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert httpx.get(f"{multi.url}/v1/models").status_code == 401  # one API key for every route
        assert httpx.post(f"{multi.url}/models/unload", json={"model": "a"}).status_code == 401


def test_concurrent_requests_to_both_models_complete_with_single_model_output(multi, single_outputs):
    results: dict[tuple[str, int], str] = {}

    def run(model: str, i: int) -> None:
        with multi.client() as http:
            r = http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 16,
                                                   "temperature": 0})
            results[model, i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(m, i)) for m in "ab" for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and set(results.values()) == {single_outputs[0]}
    samples = scrape(multi.url)
    assert metric(samples, "tokenloom:request_success_total", model_name="a") >= 4
    assert metric(samples, "tokenloom:request_success_total", model_name="b") >= 4


def test_unload_load_and_autoload(multi, single_outputs):
    with multi.client() as http:
        r = http.post("/models/unload", json={"model": "a"})
        assert r.json() == {"success": True, "model": "a", "status": {"value": "unloaded"}}
        assert statuses(http, "/models") == {"a": "unloaded", "b": "loaded", "bad": "failed"}
        assert http.get("/v1/models").json()["data"][0]["resident_bytes"] == 0
        assert greedy(http, "b") == single_outputs  # the other keeps serving
        assert greedy(http, "a") == single_outputs  # a request autoloads it
        assert statuses(http) == {"a": "loaded", "b": "loaded", "bad": "failed"}
        assert http.post("/models/unload", json={"model": "a"}).status_code == 200
        assert http.post("/models/load", json={"model": "a"}).json()["status"] == {"value": "loaded"}
        for path in ("/models/load", "/models/unload"):
            r = http.post(path, json={"model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert http.post(path, json={}).status_code == 400
        assert metric(scrape(multi.url), "tokenloom:model_loads", model_name="a") == 3
        # Nothing leaks: each unload gives the model's memory back (its ~540 MB of float32 weights stayed,
        # frozen out of the collector's reach, before), and its threads.
        before = rss_and_threads(multi.proc.pid)
        for _ in range(2):
            assert http.post("/models/unload", json={"model": "a"}).status_code == 200
            assert http.post("/models/load", json={"model": "a"}).status_code == 200
        after = rss_and_threads(multi.proc.pid)
        assert after[0] < before[0] + 150 * 2**20 and after[1] <= before[1], (before, after)


def rss_and_threads(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())  # noqa: SIM115
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


def test_a_budget_for_one_model_evicts_the_least_recently_used(single_outputs):
    # Each model takes ~540 MB of float32 weights + 256 MiB of KV: a budget of 1.2 GB holds one.
    server = ServerProcess([f"a={MODEL}", f"b={MODEL}", "--memory-budget", "1200000000"])
    try:
        with server.client() as http:
            assert statuses(http) == {"a": "loaded", "b": "unloaded"}
            assert greedy(http, "b") == single_outputs
            assert statuses(http) == {"a": "unloaded", "b": "loaded"}
            samples = scrape(server.url)
            assert metric(samples, "tokenloom:model_evictions") == 1
            assert 0 < metric(samples, "tokenloom:models_resident_bytes") <= 1_200_000_000
    finally:
        server.stop()


def test_no_autoload_names_the_status_and_a_model_over_the_budget_is_refused_at_start():
    server = ServerProcess([f"a={MODEL}", f"b={MODEL}", "--models-max", "1", "--no-models-autoload"])
    try:
        with server.client() as http:
            r = http.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 400 and "`b` is unloaded" in r.json()["error"]["message"]
            assert http.post("/models/load", json={"model": "b"}).status_code == 200  # evicts a (models-max 1)
            assert statuses(http) == {"a": "unloaded", "b": "loaded"}
    finally:
        server.stop()
    done = subprocess.run([sys.executable, "-m", "tokenloom.cli", "serve", *BASE_ARGS, f"a={MODEL}", f"b={MODEL}",
                           "--memory-budget", "1000000"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "needs" in done.stderr and "--memory-budget is 1000000 bytes" in done.stderr, done.stderr


QWEN = "qwen2.5-coder-0.5b"


@pytest.mark.skipif(catalog.missing_pull(QWEN) is not None, reason=f"{QWEN} is not pulled (tokenloom pull {QWEN})")
def test_two_different_models_each_answer_as_their_own_server(single_outputs):
    alone = ServerProcess([QWEN], startup_timeout=300)
    try:
        with alone.client() as http:
            qwen_alone = greedy(http, None)
    finally:
        alone.stop()
    server = ServerProcess([f"smol={MODEL}", QWEN], startup_timeout=300)
    try:
        with server.client() as http:
            assert statuses(http) == {"smol": "loaded", QWEN: "loaded"}
            results: dict[str, list[str]] = {}

            def ask(model: str) -> None:
                with server.client() as client:
                    results[model] = greedy(client, model)

            threads = [threading.Thread(target=ask, args=(m,)) for m in ("smol", QWEN)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results == {"smol": single_outputs, QWEN: qwen_alone}  # both at once, each its own tokens
    finally:
        server.stop()


def test_a_preset_serves_its_models_with_their_own_flags_names_and_switches(tmp_path, single_outputs):
    """`--models-preset`: each table's own engine flags over the command line's (here `b` on the fast
    path while the command line says the exact one), its aliases answering, `pin` kept through a load
    that needs room, `load_on_startup = false` left unloaded until asked for."""
    path = tmp_path / "models.toml"
    path.write_text(f"""
[a]
source = "{MODEL}"
aliases = ["smol"]
pin = true
max_model_len = 1024

[b]
source = "{MODEL}"
quantization = "int4"
load_on_startup = false

[c]
source = "{MODEL}"
load_on_startup = false
""")
    server = ServerProcess(["--models-preset", str(path), "--models-max", "2"])
    try:
        with server.client() as http:
            assert statuses(http) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}
            assert greedy(http, "smol") == single_outputs  # the alias is `a`, the exact path as the single server
            info = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert info["a"]["pinned"] and info["a"]["max_model_len"] == 1024
            fast = http.post("/v1/completions", json={"model": "b", "prompt": PROMPTS[0], "max_tokens": 8,
                                                      "temperature": 0})
            assert fast.status_code == 200
            assert http.post("/models/load", json={"model": "c"}).status_code == 200  # evicts b, never pinned a
            assert statuses(http) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert "weights int4" in server.log_text() and "weights float32" in server.log_text()  # b's and a's plans
    finally:
        server.stop()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[a]\nsource = "{MODEL}"\nport = 8001\n')
    done = subprocess.run([sys.executable, "-m", "tokenloom.cli", "serve", *BASE_ARGS, "--models-preset", str(bad)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "[a]: unknown key 'port'" in done.stderr, done.stderr


def test_keep_alive_and_sleep_idle_unload_idle_models_and_a_bad_one_is_a_400():
    """Ollama's `keep_alive` per request and llama.cpp's `--sleep-idle-seconds`: a model idle past its
    keep-alive is unloaded (then autoloaded by the next request); a bad value is a 400 naming it."""
    import time

    server = ServerProcess([f"a={MODEL}", f"b={MODEL}", "--sleep-idle-seconds", "3600"])
    try:
        with server.client() as http:
            body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
            assert http.post("/v1/completions", json={**body, "model": "b", "keep_alive": 0}).status_code == 200
            for _ in range(40):
                if statuses(http)["b"] == "unloaded":
                    break
                time.sleep(0.25)
            assert statuses(http) == {"a": "loaded", "b": "unloaded"}  # a: an hour of keep-alive left
            assert metric(scrape(server.url), "tokenloom:model_sleeps") == 1
            r = http.post("/v1/completions", json={**body, "model": "b", "keep_alive": "-1"})
            assert r.status_code == 200 and statuses(http)["b"] == "loaded"
            for bad in ("forever", True, [5], "1e400", 10**400):
                r = http.post("/v1/completions", json={**body, "model": "a", "keep_alive": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive", (bad, r.text)
    finally:
        server.stop()
