"""An adapter's life on a server, in process over the tiny random model (fast): one state machine in the
adapter manager (engine/lora_manager.py), requests pinned under the lock unload checks, an unload of a
name in use a 409, nothing registering a name again behind the operator's back; and every value read
from an adapter's files checked (model/lora.py), each failure a 4xx naming the file and the field."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tokenloom import EngineConfig, LoRARequest
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.lora_manager import GONE, READY, REGISTERED, AdapterBusy, AdapterGone, AdapterManager
from tokenloom.model.lora import load_adapter
from tokenloom.server.app import build_app

RACE_ITERATIONS = 1000
PREFIX = "base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight"


def write_adapter(path, cfg, r: int = 4, config: dict | str | None = None, seed: int = 0, poison=None,
                  fmt: str = "safetensors") -> str:
    """A PEFT-shaped adapter on q_proj / v_proj of every layer of the tiny model, written directly."""
    path.mkdir(parents=True, exist_ok=True)
    meta = {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"]} if config is None else config
    (path / "adapter_config.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    gen = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, out in (("q_proj", q), ("v_proj", kv)):
            tensors[PREFIX.format(layer=layer, proj=proj, ab="A")] = torch.randn(r, cfg.hidden_size, generator=gen)
            tensors[PREFIX.format(layer=layer, proj=proj, ab="B")] = torch.randn(out, r, generator=gen)
    if poison is not None:
        key = PREFIX.format(layer=1, proj="v_proj", ab="B")
        tensors[key][0, 0] = poison
    if fmt == "safetensors":
        save_file(tensors, str(path / "adapter_model.safetensors"))
    else:
        torch.save(tensors, str(path / "adapter_model.bin"))
    return str(path)


# -- the state machine, in the manager --------------------------------------------------------------


def test_states_and_pins(tiny_model, tmp_path):
    manager = AdapterManager(tiny_model.config, max_cpu_loras=1, max_lora_rank=8, auto_register=False)
    a = LoRARequest("a", 1, write_adapter(tmp_path / "a", tiny_model.config))
    b = LoRARequest("b", 2, write_adapter(tmp_path / "b", tiny_model.config, seed=1))
    assert manager.state("a") == GONE
    manager.load(a)
    assert manager.state("a") == READY and not manager.pins
    manager.load(b)  # max_cpu_loras 1: "a" is evicted from memory and stays registered
    assert manager.state("a") == REGISTERED and manager.state("b") == READY
    assert manager.admit("a") == a
    with pytest.raises(AdapterBusy, match="being admitted"):
        manager.unregister("a")
    manager.ensure_loaded("a")
    manager.acquire(a)  # the engine's pin
    manager.release("a")  # the admission's
    with pytest.raises(AdapterBusy, match="in flight"):
        manager.unregister("a")
    manager.release("a")
    manager.unregister("a")
    assert manager.state("a") == GONE
    with pytest.raises(AdapterGone):
        manager.admit("a")
    with pytest.raises(AdapterGone):  # a request cannot bring it back: only the operator's load can
        manager.acquire(a)
    assert manager.state("a") == GONE and not manager.pins
    manager.load(a)
    assert manager.state("a") == READY


def test_a_load_that_fails_leaves_no_name_behind(tiny_model, tmp_path):
    manager = AdapterManager(tiny_model.config, max_cpu_loras=2, max_lora_rank=8)
    bad = LoRARequest("bad", 1, write_adapter(tmp_path / "bad", tiny_model.config, poison=math.nan))
    with pytest.raises(ValueError, match="NaN"):
        manager.load(bad)
    assert manager.state("bad") == GONE and not manager.pins and not manager.loading
    with pytest.raises(ValueError, match="NaN"):
        manager.acquire(bad)  # offline (auto_register): the same
    assert manager.state("bad") == GONE and not manager.pins


# -- on the server ----------------------------------------------------------------------------------


def run_app(tiny_model, tokenizer, fn, app_kwargs=None, **engine_kwargs):
    async def main():
        engine = LLMEngine(EngineConfig(enable_lora=True, max_model_len=256, num_kv_blocks=128, max_lora_rank=8,
                                        **engine_kwargs), model=tiny_model, tokenizer=tokenizer)
        async_llm = AsyncLLM(engine, num_threads=1)
        app = build_app(async_llm, "tiny", shutdown_timeout=5, allow_runtime_lora_updating=True,
                        model_path="/srv/models/tiny.gguf", **(app_kwargs or {}))
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t",
                                                                       timeout=60) as client:
            result = await fn(client, app.state.tokenloom)
        assert not engine.has_unfinished_requests()
        return result

    return asyncio.run(main())


async def load(client, name: str, path: str) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


async def unload(client, name: str) -> httpx.Response:
    return await client.post("/v1/unload_lora_adapter", json={"lora_name": name})


async def complete(client, model: str, delay: float = 0.0) -> httpx.Response:
    if delay:
        await asyncio.sleep(delay)
    return await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})


def test_unload_while_requests_are_admitted_loses_and_sticks_no_name(tiny_model, tokenizer, tmp_path):
    """Issue 57 #2: an unload racing a request's admission answered 200, the request ran under the
    unloaded adapter and re-registered it: the name could be neither loaded nor unloaded. Here the race
    is run RACE_ITERATIONS times, the two orders and several interleavings (the request first, the
    unload first, the unload a few loop turns in; with an evicted adapter the request's admission also
    waits on its files)."""
    paths = {n: write_adapter(tmp_path / n, tiny_model.config, seed=i) for i, n in enumerate(("ok", "other"))}
    rng = random.Random(57)

    async def scenario(client, state):
        outcomes = {"unload_200": 0, "unload_409": 0, "request_200": 0, "request_404": 0}
        assert (await load(client, "other", paths["other"])).status_code == 200
        for i in range(RACE_ITERATIONS):
            r = await load(client, "ok", paths["ok"])
            assert r.status_code == 200, (i, r.text)  # never "already registered": nothing stuck
            if i % 3 == 0:  # max_cpu_loras 1: "ok" is out of memory, its admission reads its files
                assert (await complete(client, "other")).status_code == 200
            turns = rng.randrange(4)

            async def late_unload(turns=turns):
                for _ in range(turns):
                    await asyncio.sleep(0)
                return await unload(client, "ok")

            if i % 2:
                req, unl = await asyncio.gather(complete(client, "ok"), late_unload())
            else:
                unl, req = await asyncio.gather(late_unload(), complete(client, "ok"))
            assert req.status_code in (200, 404), (i, req.text)
            assert unl.status_code in (200, 409), (i, unl.text)
            if unl.status_code == 409:
                assert unl.json()["error"]["code"] == "adapter_in_use"
                assert (await unload(client, "ok")).status_code == 200  # the request has finished
            else:
                assert req.status_code == 404 or req.status_code == 200
            outcomes[f"unload_{unl.status_code}"] += 1
            outcomes[f"request_{req.status_code}"] += 1
            # gone everywhere: not listed, not registered, not pinned, and a second unload is a 404
            assert state.adapters.state("ok") == GONE and "ok" not in state.loras, i
            assert "ok" not in state.adapters.pins and not state.adapters.loading
            assert (await unload(client, "ok")).status_code == 404
        assert not state.adapters.pins
        return outcomes

    outcomes = run_app(tiny_model, tokenizer, scenario, max_loras=1, max_cpu_loras=1)
    assert sum(outcomes.values()) == 2 * RACE_ITERATIONS
    assert outcomes["unload_409"] > 0 and outcomes["unload_200"] > 0, outcomes  # both sides of the race ran
    print(f"adapter race x{RACE_ITERATIONS}: {outcomes}, 0 lost or stuck names")


def test_an_unloaded_name_is_a_404_for_requests(tiny_model, tokenizer, tmp_path):
    path = write_adapter(tmp_path / "x", tiny_model.config)

    async def scenario(client, state):
        assert (await load(client, "x", path)).status_code == 200
        assert (await complete(client, "x")).status_code == 200
        assert (await unload(client, "x")).status_code == 200
        r = await complete(client, "x")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert state.adapters.state("x") == GONE  # the request did not bring it back
        assert (await load(client, "x", path)).status_code == 200

    run_app(tiny_model, tokenizer, scenario)


def test_lora_modules_may_not_take_the_base_models_name(tiny_model, tokenizer, tmp_path):
    engine = LLMEngine(EngineConfig(enable_lora=True, max_model_len=256, num_kv_blocks=64, max_lora_rank=8),
                       model=tiny_model, tokenizer=tokenizer)
    lora = LoRARequest("tiny", 1, write_adapter(tmp_path / "t", tiny_model.config))
    for names in ("tiny", ["other", "tiny"]):
        with pytest.raises(ValueError, match="base model's served name"):
            build_app(AsyncLLM(engine, num_threads=1), names, lora_modules=[lora])


# -- every value read from an adapter's files ---------------------------------------------------------


BAD_CONFIGS = [
    ('{"r": Infinity}', "r: must be an integer"),
    ('{"r": -Infinity}', "r: must be an integer"),
    ('{"r": NaN}', "r: must be an integer"),
    ('{"r": 1e400}', "r: must be an integer"),
    ('{"r": "4"}', "r: must be an integer"),
    ('{"r": "secret-contents"}', "r: must be an integer"),
    ('{"r": 4, "lora_alpha": "secret-contents"}', "lora_alpha"),
    ('{"r": 4, "use_dora": "secret-contents"}', "use_dora: must be true or false"),
    ('{"r": 4.5}', "r: must be an integer"),
    ('{"r": true}', "r: must be an integer"),
    ('{"r": 0}', "must be positive"),
    ('{"r": 64}', "above max_lora_rank"),
    ('{"r": 4, "lora_alpha": NaN}', "lora_alpha: must be a finite number"),
    ('{"r": 4, "lora_alpha": 1e400}', "lora_alpha: must be a finite number"),
    ('{"r": 4, "lora_alpha": -8}', "lora_alpha: must be a finite number"),
    ('{"r": 4, "lora_alpha": 1e30}', "lora_alpha: must be a finite number"),
    ('{"r": 4, "lora_alpha": "16"}', "lora_alpha: must be a finite number"),
    ('{"r": 4, "use_rslora": "yes"}', "use_rslora: must be true or false"),
    ('[4]', "a JSON object is needed"),
    ('"secret-contents"', "a JSON object is needed"),
    ('null', "a JSON object is needed"),
    ('{"r": 4', "not UTF-8 JSON"),
    ('\udcff', "not UTF-8 JSON"),
    ("[" * 100_000, "not UTF-8 JSON"),
]


@pytest.mark.parametrize("text,error", BAD_CONFIGS)
def test_adapter_config_values_are_checked(tiny_model, tmp_path, text, error):
    path = tmp_path / "a"
    write_adapter(path, tiny_model.config)
    (path / "adapter_config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=error) as info:
        load_adapter(str(path), "a", tiny_model.config, 8)
    message = str(info.value)
    assert "adapter_config.json" in message  # names the file
    assert "secret-contents" not in message and "Traceback" not in message


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_non_finite_weights_are_refused(tiny_model, tmp_path, poison, fmt):
    path = write_adapter(tmp_path / "a", tiny_model.config, poison=poison, fmt=fmt)
    with pytest.raises(ValueError, match="NaN or infinite") as info:
        load_adapter(path, "a", tiny_model.config, 8)
    assert "layers.1.v_proj.lora_B" in str(info.value) and "adapter_model" in str(info.value)


def test_a_scale_that_overflows_float32_is_refused(tiny_model, tmp_path):
    path = write_adapter(tmp_path / "a", tiny_model.config, config={"r": 4, "lora_alpha": 1e6}, poison=3e38)
    with pytest.raises(ValueError, match="not finite in float32"):
        load_adapter(path, "a", tiny_model.config, 8)


def test_header_and_shapes_are_checked_before_any_tensor_is_read(tiny_model, tmp_path, monkeypatch):
    """A huge file with the wrong shapes is refused from its header: no tensor is read."""
    import safetensors

    read = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: read.append(1) or real(*a, **k))
    path = tmp_path / "a"
    write_adapter(path, tiny_model.config)
    st = path / "adapter_model.safetensors"
    key = PREFIX.format(layer=0, proj="q_proj", ab="A")
    rows = 1 << 16  # a [65536, 64] float32 lora_A: 16 MiB where 1 KiB belongs
    header = json.dumps({key: {"dtype": "F32", "shape": [rows, 64], "data_offsets": [0, rows * 64 * 4]}}).encode()
    with open(st, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + rows * 64 * 4)
    with pytest.raises(ValueError, match="has shape") as info:
        load_adapter(str(path), "a", tiny_model.config, 8)
    assert "adapter_model.safetensors" in str(info.value) and not read
    for bad_header, error in [
        ({key: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 10]}}, "data_offsets"),
        ({key: {"dtype": "I64", "shape": [4, 64], "data_offsets": [0, 2048]}}, "float tensor"),
        ({key: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}, "bytes but its header"),
        ({"model.embed_tokens.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "adapts something"),
        ([1, 2], "not a JSON object"),
    ]:
        text = json.dumps(bad_header).encode()
        st.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 4)
        with pytest.raises(ValueError, match=error):
            load_adapter(str(path), "a", tiny_model.config, 8)
    st.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length"):
        load_adapter(str(path), "a", tiny_model.config, 8)
    assert not read


@pytest.mark.parametrize("text,error", [('{"r": Infinity}', "r: must be an integer"),
                                        ('{"r": 4, "lora_alpha": NaN}', "lora_alpha"),
                                        ('{"r": 4, "lora_alpha": 1e400}', "lora_alpha")])
def test_bad_adapters_over_http_are_400s_naming_file_and_field(tiny_model, tokenizer, tmp_path, text, error):
    path = tmp_path / "a"
    write_adapter(path, tiny_model.config)
    (path / "adapter_config.json").write_text(text)
    nan = write_adapter(tmp_path / "nan", tiny_model.config, poison=math.nan)

    async def scenario(client, state):
        for p, why in ((str(path), error), (nan, "NaN")):
            r = await load(client, "a", p)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert why in message and "adapter_" in message, message
            assert state.adapters.state("a") == GONE and "a" not in state.loras
        r = await client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 404

    run_app(tiny_model, tokenizer, scenario)


def test_errors_never_quote_what_the_files_hold(tiny_model, tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "a"
    write_adapter(path, tiny_model.config)
    st = path / "adapter_model.safetensors"
    tensors = load_file(str(st))
    key = PREFIX.format(layer=0, proj="q_proj", ab="A")
    for renamed, error in [("secret-contents." + key.replace("base_model.model.", ""), "has shape"),
                           ("secret-contents.embed", "adapts something")]:
        bad = dict(tensors)
        bad[renamed] = torch.zeros(3, 3)
        save_file(bad, str(st))
        with pytest.raises(ValueError, match=error) as info:
            load_adapter(str(path), "a", tiny_model.config, 8)
        assert "secret" not in str(info.value), str(info.value)


@pytest.mark.parametrize("api_key", [None, "K"])
def test_models_lists_names_and_paths_only_for_the_operator(tiny_model, tokenizer, tmp_path, api_key):
    path = write_adapter(tmp_path / "x", tiny_model.config)
    api = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def scenario(client, state):
        assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path},
                                  headers=api)).status_code == 200
        text = (await client.get("/v1/models", headers=api)).text
        assert str(tmp_path) not in text and "/srv/models" not in text and "lora_path" not in text
        models = {m["id"]: m for m in (await client.get("/v1/models", headers=api)).json()["data"]}
        assert models["tiny"]["root"] == "tiny" and models["x"]["root"] == "x" and models["x"]["parent"] == "tiny"
        operator = (await client.get("/v1/models", headers={"Authorization": "Bearer MT"})).json()["data"]
        by_id = {m["id"]: m for m in operator}
        assert by_id["tiny"]["root"] == "/srv/models/tiny.gguf" and by_id["x"]["lora_path"] == path
        # the metrics token opens only this listing, not the API
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                              headers={"Authorization": "Bearer MT"})
        assert r.status_code == (401 if api_key else 200)

    run_app(tiny_model, tokenizer, scenario, {"api_key": api_key, "metrics_token": "MT"})


def test_a_request_whose_adapter_goes_while_its_prompt_is_read_is_a_404_not_the_base(tiny_model, tokenizer, tmp_path):
    """The name is checked first, the adapter pinned after the prompt is tokenized: an unload in between
    must not leave the request to run on the base model."""
    path = write_adapter(tmp_path / "x", tiny_model.config)

    async def scenario(client, state):
        assert (await load(client, "x", path)).status_code == 200
        real_encode = state.encode

        async def encode_then_unload(*args, **kwargs):
            ids = await real_encode(*args, **kwargs)
            state.adapters.unregister("x")  # as the unload route does, between the check and the pin
            del state.loras["x"]
            return ids

        state.encode = encode_then_unload
        r = await complete(client, "x")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text

    run_app(tiny_model, tokenizer, scenario)
