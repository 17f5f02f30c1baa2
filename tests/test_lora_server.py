"""LoRA adapters behind a real `tokenloom serve` on SmolLM2 (vLLM's interface): --lora-modules, the
adapters in /v1/models, `model` choosing one, run-time load/unload and their errors (slow)."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import peft
import pytest
import torch
import transformers
from conftest_server import ServerProcess

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.model.loader import bundled_model_path

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


def make_smollm2_adapter(path, seed: int, targets: list[str], rank: int = 8) -> None:
    """A seeded random PEFT adapter (rank 8 by default) with SmolLM2-135M's shapes, made by peft itself."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(cfg)
    base = base.to_empty(device="cpu")
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * (0.05 if "lora_A" in name else 0.5))
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-adapters")
    out = {}
    for i, (name, targets) in enumerate([("alpha", ["q_proj", "v_proj", "down_proj"]),
                                         ("beta", ["o_proj", "gate_proj", "up_proj", "k_proj"]),
                                         ("gamma", ["q_proj", "k_proj", "v_proj", "o_proj"])]):
        make_smollm2_adapter(root / name, seed=i, targets=targets)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def server(adapters):
    srv = ServerProcess(["--enable-lora", "--max-loras", "2", "--lora-modules", f"alpha={adapters['alpha']}",
                         f'{{"name": "beta", "path": "{adapters["beta"]}"}}', "--allow-runtime-lora-updating"])
    yield srv
    srv.stop()


def complete(client: httpx.Client, model: str, max_tokens: int = 24) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                "temperature": 0})


def test_models_lists_adapters_with_their_parent(server):
    with server.client() as c:
        data = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    base = next(name for name, m in data.items() if "parent" not in m)
    assert data["alpha"]["parent"] == base and data["beta"]["parent"] == base


def test_a_request_through_an_adapter_matches_the_offline_engine(server, adapters):
    """float32: the server's greedy tokens under an adapter are the offline LLM's with the same adapter
    (and not the base model's)."""
    with server.client() as c:
        served = {m: complete(c, m).json()["choices"][0]["text"] for m in ("alpha", "beta")}
        base = complete(c, c.get("/v1/models").json()["data"][0]["id"]).json()["choices"][0]["text"]
    llm = LLM(enable_lora=True, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=24)
    for i, name in enumerate(("alpha", "beta"), start=1):
        offline = llm.generate([PROMPT], params, use_tqdm=False,
                               lora_request=LoRARequest(name, i, adapters[name]))[0].outputs[0].text
        assert served[name] == offline, name
        assert served[name] != base


def test_unknown_adapter_is_404(server):
    with server.client() as c:
        r = complete(c, "no-such-adapter")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(server, adapters, tmp_path):
    with server.client() as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
        assert r.status_code == 200, r.text
        assert "gamma" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert complete(c, "gamma").status_code == 200
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
        assert again.status_code == 400 and "already" in again.json()["error"]["message"]
        missing = c.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(tmp_path / "none")})
        assert missing.status_code == 400 and "not a PEFT adapter" in missing.json()["error"]["message"]
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "x"}).status_code == 400
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
        assert complete(c, "gamma").status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 404


def test_unloading_an_adapter_in_use_is_refused_and_its_request_finishes(server, adapters):
    with server.client() as c:
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": adapters["gamma"]}
                      ).status_code == 200
        streaming, result = threading.Event(), {}

        def long_request():
            body = {"model": "busy", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            with server.client() as c2, c2.stream("POST", "/v1/completions", json=body) as r:
                result["status"] = r.status_code
                result["chunks"] = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        result["chunks"] += 1
                        streaming.set()
            streaming.set()

        t = threading.Thread(target=long_request)
        t.start()
        assert streaming.wait(120)
        refused = c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        t.join()
        assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"], refused.text
        assert result["status"] == 200 and result["chunks"] >= 290  # it went on to the end
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200


def test_adapters_need_enable_lora():
    from tokenloom.server.lora_routes import parse_lora_modules

    assert [r.lora_name for r in parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}'])] == ["a", "b"]
    # argv's undecodable bytes arrive as lone surrogates: such a name would break /v1/models' JSON
    for bad in (["nopath"], ['{"name": "a"}'], ["a=/x", "a=/y"], ["=/x"], ["\udcff=/x"], ["a\nb=/x"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)


def test_runtime_lora_names_must_be_valid_unicode():
    from pydantic import ValidationError

    from tokenloom.server.lora_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    for model in (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest):
        with pytest.raises(ValidationError, match="unicode|surrogate"):
            model.model_validate({"lora_name": "\ud800", "lora_path": "/x"} if model is LoadLoRAAdapterRequest
                                 else {"lora_name": "\ud800"})


def test_each_model_of_a_multi_model_server_serves_its_own_adapters(server, adapters, tmp_path):
    """A models preset gives `a` its adapters (`lora_modules`); `b`, the same file, has none. A request
    naming an adapter goes to its model and equals the single-model server's answer under it; one loaded
    at run time (`?model=b`) is served by `b`; a request for an adapter of an unloaded model loads it."""
    with server.client() as c:
        single = complete(c, "alpha").json()["choices"][0]["text"]
    preset = tmp_path / "models.toml"
    preset.write_text(f'[a]\nsource = "{bundled_model_path()}"\nenable_lora = true\n'
                      f'lora_modules = ["alpha={adapters["alpha"]}"]\n'
                      f'[b]\nsource = "{bundled_model_path()}"\nenable_lora = true\n')
    multi = ServerProcess(["--models-preset", str(preset), "--allow-runtime-lora-updating"])
    try:
        with multi.client() as c:
            listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert listed["alpha"]["parent"] == "a" and "parent" not in listed["b"]
            assert complete(c, "alpha").json()["choices"][0]["text"] == single
            for taken in ("a", "alpha"):  # a model's name, another model's adapter: they route elsewhere
                r = c.post("/v1/load_lora_adapter?model=b", json={"lora_name": taken, "lora_path": adapters["gamma"]})
                assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
            r = c.post("/v1/load_lora_adapter?model=b", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
            assert r.status_code == 200, r.text
            assert complete(c, "gamma").status_code == 200
            assert {m["id"]: m for m in c.get("/v1/models").json()["data"]}["gamma"]["parent"] == "b"
            assert c.post("/models/unload", json={"model": "a"}).status_code == 200
            assert complete(c, "alpha").json()["choices"][0]["text"] == single  # autoloads `a`
            assert complete(c, "beta").status_code == 404  # the single server's adapter, not this one's
    finally:
        multi.stop()


def test_a_preset_s_adapters_are_checked_at_start(tmp_path):
    from tokenloom.server.model_set import parse_models_preset
    from tokenloom.server.multi_flags import preset_flags

    for table, says in (("lora_modules = 'x=/y'", "must be a list"), ("lora_modules = ['nopath']", "not name=path"),
                        ("lora_modules = ['a=/x']", "two models are served as 'a'")):
        path = tmp_path / "models.toml"
        path.write_text(f"[a]\nsource = 'x'\n{table}\n")
        with pytest.raises(ValueError, match=says) as err:
            parse_models_preset(str(path), preset_flags)
        assert "--models-preset" in str(err.value)
    model = bundled_model_path()
    for table, extra, says in (
            ("lora_modules = ['x=/y']", [], "lora_modules need enable_lora = true"),
            (f"enable_lora = true\nlora_modules = ['x={tmp_path / 'none'}']", [], "is not a directory"),
            (f"enable_lora = true\nlora_modules = [{{name = 'x', path = '{tmp_path}'}}]", ["--cascade", "x=a,b"],
             "'x' is already a model's name")):
        path.write_text(f"[a]\nsource = '{model}'\n{table}\n[b]\nsource = '{model}'\n")
        done = subprocess.run([sys.executable, "-m", "tokenloom.cli", "serve", "--models-preset", str(path), "--port",
                               "0", *extra], check=False, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and says in done.stderr, done.stderr
        assert "--models-preset" in done.stderr or "--cascade" in done.stderr
