"""Schema-driven fuzzing of a live `tokenloom serve`: schemathesis generates requests for every
route in /openapi.json, schema-conforming and schema-violating alike, and no answer may be a 5xx.
Generation is capped (max_tokens, n) so the whole run takes minutes on a shared CPU. The server
runs the default fast path (`--quantization auto`), as users run it.

The number of requests per operation is PER_BODY_OPERATION (default sums to >= 10,000 across the
routes); set TOKENLOOM_FUZZ_EXAMPLES to scale it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import urllib.parse
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest
import requests
import schemathesis
from conftest_server import ServerProcess, metric, scrape, wait_for
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

BODY_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
PER_BODY_OPERATION = int(os.environ.get("TOKENLOOM_FUZZ_EXAMPLES", "1300"))  # x2 modes x4 routes = 10,400
PER_OTHER_OPERATION = 50
CONCURRENCY = 16  # requests in flight, over all generators
GENERATORS = 2  # processes drawing cases: drawing is single-threaded Python, the slow part of the test


@pytest.fixture(scope="module")
def server():
    # Adapters on and loadable at run time: the adapter routes are fuzzed past "not enabled" (below too).
    srv = ServerProcess(["--max-model-len", "512", "--max-num-seqs", "16", "--quantization", "auto",
                         "--enable-lora", "--allow-runtime-lora-updating"])
    yield srv
    srv.stop()


def _cap(case) -> None:
    """Keep generation cheap: at most 2 new tokens and 2 choices when those fields are integers."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2), ("best_of", 2), ("min_tokens", 2)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if case.path in ("/v1/completions", "/v1/chat/completions") and body.get("max_tokens", 0) is None:
        body["max_tokens"] = 2  # null = up to the context: valid, but minutes of CPU here
    if body.get("stream") is True:
        body["stream"] = False  # a stream's status is sent first; a 5xx inside shows as an error event (checked below)
    if body.get("max_tokens") is None and case.path == "/v1/chat/completions":
        body["max_tokens"] = 2


def test_openapi_documents_every_route_body(server):
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    paths = spec["paths"]
    for route in BODY_ROUTES:
        body = paths[route]["post"]["requestBody"]
        assert body["required"] and "application/json" in body["content"]
    for route in ("/health", "/version", "/v1/models", "/metrics"):
        assert "get" in paths[route]


def test_fuzz_every_route_no_5xx(server):
    """Hypothesis draws the cases; GENERATORS processes share every route's examples (drawing is the
    slow part, in one Python thread per process), each sending from a pool of threads so the engine
    batches them."""
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    with ProcessPoolExecutor(GENERATORS, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = list(pool.map(fuzz_share, [server.url] * GENERATORS, [spec] * GENERATORS, range(GENERATORS)))
    tried, statuses = sum((t for t, _, _ in shares), Counter()), sum((s for _, s, _ in shares), Counter())
    failures = [f for _, _, fs in shares for f in fs]
    total = sum(tried.values())
    print(f"\nfuzz: {total} requests {dict(tried)} statuses {dict(statuses)}")
    with open(os.environ.get("TOKENLOOM_FUZZ_REPORT", os.devnull), "w") as f:
        f.write(f"{total} {dict(tried)} {dict(statuses)}\n")
    assert not failures, "\n".join(failures[:10])
    assert total >= min(10_000, 8 * PER_BODY_OPERATION)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert wait_for(lambda: metric(scrape(server.url), "tokenloom:num_requests_running") == 0, timeout=5)


def fuzz_share(url: str, spec: dict, share: int) -> tuple[Counter, Counter, list[str]]:
    """This process's share of every operation's examples (its own hypothesis seed), sent to `url`:
    requests per route, statuses, and what failed."""
    schema = schemathesis.openapi.from_dict(spec)
    tried: Counter = Counter()
    statuses: Counter = Counter()
    failures: list[str] = []
    local = threading.local()
    slots = threading.Semaphore(CONCURRENCY // GENERATORS)
    lock = threading.Lock()

    def send(path: str, case) -> None:
        try:
            session = getattr(local, "session", None) or requests.Session()
            local.session = session
            response = case.call(base_url=url, session=session, timeout=300)
            bad = None
            if response.status_code >= 500 and not (response.status_code == 503 and path == "/health"):
                bad = f"{case.method} {path} -> {response.status_code}: {response.text[:300]} body={str(case.body)[:300]!r}"
            elif response.status_code >= 400 and "error" not in response.json():
                bad = f"{case.method} {path} -> {response.status_code} without an OpenAI error body: {response.text[:300]}"
            with lock:
                tried[path] += 1
                statuses[response.status_code] += 1
                if bad:
                    failures.append(bad)
        except Exception as exc:  # noqa: BLE001 - a hang or a dropped connection is a failure too
            with lock:
                failures.append(f"{case.method} {path}: {exc!r} body={str(case.body)[:300]!r}")
        finally:
            slots.release()

    with ThreadPoolExecutor(CONCURRENCY // GENERATORS) as pool:
        for result in schema.get_all_operations():
            op = result.ok()
            examples = PER_BODY_OPERATION if op.path in BODY_ROUTES else PER_OTHER_OPERATION
            examples = examples // GENERATORS + (share < examples % GENERATORS)
            modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.path in BODY_ROUTES else (GenerationMode.POSITIVE,)
            for mode in modes:

                @seed(share)
                @settings(max_examples=examples, deadline=None, database=None,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case):  # runs right below, inside this iteration: `op` is current
                    _cap(case)
                    slots.acquire()
                    pool.submit(send, op.path, case)  # noqa: B023

                run()
    return tried, statuses, failures


# -- grammar-shaped fields: a hypothesis strategy that grows schemas, regexes and grammars deep and wide --

from hypothesis import strategies as st


def _schemas():
    leaf = st.sampled_from([{"type": "integer"}, {"type": "string"}, {"type": "boolean"},
                            {"type": "string", "maxLength": 5000}, {"enum": ["a", "b"]}])

    def grow(inner):
        return st.one_of(
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=4), inner, min_size=1, max_size=8)
            .map(lambda props: {"type": "object", "properties": props, "required": list(props)}),
            st.builds(lambda s: {"type": "array", "items": s, "maxItems": 3}, inner),
            st.lists(inner, min_size=1, max_size=6).map(lambda xs: {"anyOf": xs}),
        )

    shallow = st.recursive(leaf, grow, max_leaves=60)
    # Deep on purpose: chains of $refs and nestings past every limit, to either side of it.
    chains = st.integers(1, 1500).map(lambda n: {"$ref": "#/$defs/d0", "$defs": {
        **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}, f"d{n}": {"type": "integer"}}})
    # Nested dicts stay within what the client's own JSON encoder can write (~300 levels); deeper ones
    # go as text (_schema_texts).
    nested = st.integers(1, 300).map(lambda n: json.loads('{"anyOf":[' * n + '{"type":"integer"}' + "]}" * n))
    return st.one_of(shallow, chains, nested)


def _schema_texts():
    """guided_json as a string, nested up to 100,000 deep (json.loads of it in the server would recurse)."""
    return st.integers(1, 100_000).map(lambda n: '{"anyOf":[' * n + '{"type":"integer"}' + "]}" * n)


def _regexes():
    atom = st.sampled_from(["a", "[a-z]", r"\d", ".", "(ab|cd)", "x*"])
    count = st.integers(1, 3000).map(lambda n: f"{{{n}}}")
    return st.recursive(atom, lambda inner: st.one_of(
        st.tuples(inner, count).map(lambda t: f"({t[0]}){t[1]}"),
        st.lists(inner, min_size=2, max_size=5).map("|".join),
        st.lists(inner, min_size=2, max_size=5).map("".join)), max_leaves=12)


def _grammars():
    chain = st.integers(1, 4000).map(lambda n: "\n".join(
        ["start: r0", *(f"r{i}: r{i + 1} | \"t{i}\"" for i in range(n)), f'r{n}: "x"']))
    wide = st.integers(1, 3000).map(lambda n: "\n".join(
        ["root ::= " + " | ".join(f"r{i}" for i in range(n)), *(f'r{i} ::= "w{i}"' for i in range(n))]))
    deep_parens = st.integers(1, 3000).map(lambda n: 'root ::= ' + "(" * n + '"a"' + ")" * n)
    return st.one_of(chain, wide, deep_parens)


GRAMMAR_FIELDS = st.one_of(
    _schemas().map(lambda s: {"guided_json": s}),
    _schema_texts().map(lambda s: {"guided_json": s}),
    _schemas().map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": s}}}),
    _regexes().map(lambda r: {"guided_regex": r}),
    _grammars().map(lambda g: {"guided_grammar": g}),
    _grammars().map(lambda g: {"structured_outputs": {"grammar": g}}),
    st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3000).map(lambda c: {"guided_choice": c}),
)
GRAMMAR_EXAMPLES = int(os.environ.get("TOKENLOOM_FUZZ_GRAMMAR_EXAMPLES", "100"))


def test_fuzz_grammar_fields_never_5xx_nor_kill_the_server(server):
    """Every generated grammar is either served (200) or refused (400 naming the field or the limit);
    the server lives through all of them and /health stays truthful."""
    failures: list[str] = []
    statuses: Counter = Counter()
    session = requests.Session()

    @settings(max_examples=GRAMMAR_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(fields=GRAMMAR_FIELDS, n=st.sampled_from([1, 1, 4]))
    def run(fields, n):
        body = {"prompt": "Answer:", "max_tokens": 2, "n": n, "temperature": 1.0, "seed": 0, **fields}
        r = session.post(server.url + "/v1/completions", json=body, timeout=300)
        statuses[r.status_code] += 1
        if r.status_code not in (200, 400) or "error" not in r.json() and r.status_code == 400:
            failures.append(f"{r.status_code}: {r.text[:300]} fields={str(fields)[:200]}")
        if server.proc.poll() is not None:
            failures.append(f"server exited ({server.proc.returncode}) after fields={str(fields)[:200]}")

    run()
    print(f"\ngrammar fuzz: statuses {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert statuses[200] and statuses[400]  # both sides of the limits were reached
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert wait_for(lambda: metric(scrape(server.url), "tokenloom:num_requests_running") == 0, timeout=10)



# -- the adapter routes and the dashboard's query (issue 57) ------------------------------------------

_JSON_NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-0", "4.0", "1e-400"]))
_CONFIG_VALUES = st.one_of(_JSON_NUMBERS, st.text(max_size=20), st.booleans(), st.none(),
                           st.lists(st.integers(), max_size=3))


def _config_text(fields: dict, raw: str | None) -> str:
    if raw is not None:
        return raw
    parts = []
    for key, value in fields.items():
        text = value if isinstance(value, str) and value in ("Infinity", "-Infinity", "NaN", "1e400", "-0", "4.0",
                                                               "1e-400") else json.dumps(value)
        parts.append(f"{json.dumps(key)}: {text}")
    return "{" + ", ".join(parts) + "}"


ADAPTER_CONFIGS = st.builds(
    _config_text,
    st.dictionaries(st.sampled_from(["r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out",
                                     "target_modules", "x"]), _CONFIG_VALUES, max_size=5),
    st.one_of(st.none(), st.none(), st.text(max_size=200), st.sampled_from(["[", "[]", "null", '"r"', "{" * 5000])),
)
ADAPTER_EXAMPLES = int(os.environ.get("TOKENLOOM_FUZZ_ADAPTER_EXAMPLES", "200"))


def test_fuzz_adapter_routes_never_5xx(server, tmp_path_factory):
    """Generated adapter directories (configs of every value type, JSON's non-finite spellings, garbage
    weights files) and names: every load is a 200 or a 4xx with an error body, every unload a
    200/404/409; the server lives and nothing stays registered that did not load."""
    root = tmp_path_factory.mktemp("fuzz-adapters")
    failures: list[str] = []
    statuses: Counter = Counter()
    session = requests.Session()
    counter = iter(range(10**9))

    @settings(max_examples=ADAPTER_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(config=ADAPTER_CONFIGS, weights=st.one_of(st.none(), st.binary(max_size=64),
                                                    st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "little"))),
           name=st.text(min_size=1, max_size=40))
    def run(config, weights, name):
        path = root / str(next(counter))
        path.mkdir()
        (path / "adapter_config.json").write_bytes(config.encode("utf-8", "surrogatepass"))
        if weights is not None:
            (path / "adapter_model.safetensors").write_bytes(weights + b"{}")
        r = session.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                         timeout=60)
        statuses[r.status_code] += 1
        if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
            failures.append(f"load {r.status_code}: {r.text[:300]} config={config[:200]!r}")
        u = session.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        statuses[f"unload {u.status_code}"] += 1
        if u.status_code not in (200, 400, 404, 409, 422):
            failures.append(f"unload {u.status_code}: {u.text[:300]}")
        if server.proc.poll() is not None:
            failures.append(f"server exited ({server.proc.returncode}) after config={config[:200]!r}")

    run()
    print(f"\nadapter fuzz: statuses {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    listed = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert all("parent" not in m for m in listed), listed  # nothing left registered
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


DASHBOARD_QUERIES = st.one_of(
    st.lists(st.tuples(st.sampled_from(["rate", "token", "api_key", "", "rate[]"]) | st.text(max_size=10),
                       st.text(max_size=20) | _JSON_NUMBERS.map(str)), max_size=4)
    .map(lambda pairs: urllib.parse.urlencode(pairs)),
    st.text(max_size=60).map(lambda t: urllib.parse.quote(t, safe="=&%+;")),
)


def test_fuzz_dashboard_query_never_5xx(server):
    """Generated query strings on /dashboard/stream and /dashboard/stats: 200, 400 naming a parameter,
    or 503 (viewer cap) with an error body, and never a viewer left behind."""
    failures: list[str] = []
    statuses: Counter = Counter()

    @settings(max_examples=ADAPTER_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(query=DASHBOARD_QUERIES, route=st.sampled_from(["/dashboard/stream", "/dashboard/stats"]))
    def run(query, route):
        with requests.get(f"{server.url}{route}?{query}", stream=True, timeout=30) as r:
            statuses[r.status_code] += 1
            if r.status_code not in (200, 400, 503) or (r.status_code != 200 and "error" not in r.json()):
                failures.append(f"{route}?{query} -> {r.status_code}: {r.text[:300]}")

    run()
    print(f"\ndashboard query fuzz: statuses {dict(statuses)}")
    assert not failures, "\n".join(failures[:10])
    assert statuses[200] and statuses[400]
    assert wait_for(lambda: requests.get(server.url + "/dashboard/stats", timeout=10).json()["viewers"] == 0,
                    timeout=30)
