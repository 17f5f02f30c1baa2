"""LoRA adapters (model/lora.py, engine/lora_manager.py): PEFT files made here with `peft`, exactness
against the weights merged by peft itself, batches mixing adapters and the base, caches keyed by adapter."""

from __future__ import annotations

import copy
import json
import os

import peft  # makes the test adapters (a test dependency, with transformers)
import pytest
import torch
import transformers

from tokenloom import EngineConfig, LoRARequest, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.lora_manager import AdapterManager
from tokenloom.model.lora import load_adapter, merge_into

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_twin(model) -> transformers.LlamaForCausalLM:
    """A transformers Llama holding the tiny model's weights (q/k/v and gate/up split back)."""
    cfg = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings))
    q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    with torch.no_grad():
        for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
            qkv = ours.self_attn.qkv_proj.weight
            theirs.self_attn.q_proj.weight.copy_(qkv[:q])
            theirs.self_attn.k_proj.weight.copy_(qkv[q : q + kv])
            theirs.self_attn.v_proj.weight.copy_(qkv[q + kv :])
            theirs.self_attn.o_proj.weight.copy_(ours.self_attn.o_proj.weight)
            gate_up = ours.mlp.gate_up_proj.weight
            theirs.mlp.gate_proj.weight.copy_(gate_up[: cfg.intermediate_size])
            theirs.mlp.up_proj.weight.copy_(gate_up[cfg.intermediate_size :])
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.weight)
    return hf


def make_adapter(path, model, seed: int, r: int = 8, targets=ALL_PROJECTIONS, alpha: int = 16, **extra):
    """A PEFT adapter for the tiny model with seeded random A and B (B nonzero: it changes the outputs)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra)
    wrapped = peft.get_peft_model(hf_twin(model), config)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)  # large enough to move the greedy tokens of a random model
    wrapped.save_pretrained(str(path))
    return wrapped


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for i, (name, targets) in enumerate([("all", ALL_PROJECTIONS), ("attn", ["q_proj", "v_proj"]),
                                         ("mlp", ["gate_proj", "down_proj"])]):
        made[name] = (LoRARequest(name, i + 1, str(root / name)), make_adapter(root / name, tiny_model, seed=i,
                                                                              targets=targets))
    return made


@pytest.fixture
def lora_engine(tiny_model, tokenizer):
    engines = []

    def make(model=None, **kwargs):
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(enable_lora=True, **kwargs), model=model or tiny_model, tokenizer=tokenizer)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_unfinished_requests()
        engine.check_kv_invariants()
        assert engine.kv.all_free()
        assert not engine.adapters.pins, f"adapters still pinned: {engine.adapters.pins}"


def run(engine, prompts, params, loras):
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return [outs[str(i)] for i in range(len(prompts))]


PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_our_merge_is_peft_merge(tiny_model, adapters):
    """The mapping of PEFT's q/k/v/gate/up/down onto the fused projections, checked against peft's own merge."""
    for request, wrapped in adapters.values():
        weights = load_adapter(request.lora_path, request.lora_name, tiny_model.config, 64)
        ours = copy.deepcopy(tiny_model)
        merge_into(ours, weights)
        theirs = hf_twin(ours)  # our merged weights, split into HF's names
        merged = copy.deepcopy(wrapped).merge_and_unload()
        projections = {k: v for k, v in merged.state_dict().items() if k.endswith("_proj.weight")}
        assert len(projections) == 7 * tiny_model.config.num_layers
        ours_split = theirs.state_dict()
        for key, value in projections.items():
            assert torch.allclose(ours_split[key], value, atol=1e-5), key


def test_adapter_greedy_equals_merged_weights_alone_and_mixed(tiny_model, adapters, lora_engine, tokenizer):
    """float32: each adapter's rows give the tokens of the model with that adapter merged, alone and in one
    batch with rows of the other adapters and of the base; the base's rows are unchanged by them."""
    requests = {name: r for name, (r, _) in adapters.items()}
    base_engine = lora_engine()
    base = run(base_engine, PROMPTS, GREEDY, [None] * len(PROMPTS))
    expected = {}
    for name, request in requests.items():
        merged = copy.deepcopy(tiny_model)
        merge_into(merged, load_adapter(request.lora_path, name, tiny_model.config, 64))
        expected[name] = run(lora_engine(model=merged), PROMPTS, GREEDY, [None] * len(PROMPTS))
        assert expected[name] != base  # the adapter changes the output
        alone = run(lora_engine(), PROMPTS, GREEDY, [request] * len(PROMPTS))
        assert alone == expected[name], name
    # One batch: every prompt under every adapter and under the base, interleaved.
    engine = lora_engine(max_loras=3)
    names = [None, *requests]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [requests[n] if n else None for _ in PROMPTS for n in names]
    mixed = run(engine, prompts, GREEDY, loras)
    for k, (prompt_index, n) in enumerate((i, n) for i in range(len(PROMPTS)) for n in names):
        assert mixed[k] == (expected[n] if n else base)[prompt_index], (prompt_index, n)


def test_max_loras_bounds_the_adapters_in_a_step(adapters, lora_engine):
    engine = lora_engine(max_loras=1)
    requests = [r for r, _ in adapters.values()]
    for i in range(6):
        engine.add_request(str(i), PROMPTS[i % 4], GREEDY, lora_request=requests[i % 3])
    while engine.has_unfinished_requests():
        engine.step()
        scheduled = {sid.split("#")[0] for sid in engine.last_step.seq_ids}
        assert len({requests[int(r) % 3].lora_name for r in scheduled}) <= 1


def test_prefix_cache_is_keyed_by_adapter(adapters, lora_engine):
    """The same prompt under the base, then adapter 'all', then the base again: only the base's second
    run hits the cache (another adapter's KV is never reused)."""
    engine = lora_engine(block_size=4)
    request = adapters["all"][0]
    prompt = list(range(1000, 1040))
    one = SamplingParams(temperature=0, max_tokens=1)
    run(engine, [prompt], one, [None])
    hits = engine.kv.prefix_hits
    run(engine, [prompt], one, [request])
    assert engine.kv.prefix_hits == hits
    run(engine, [prompt], one, [request])
    assert engine.kv.prefix_hits > hits
    hits = engine.kv.prefix_hits
    run(engine, [prompt], one, [None])
    assert engine.kv.prefix_hits > hits


def test_lru_keeps_at_most_max_cpu_loras_and_reloads(tiny_model, adapters):
    manager = AdapterManager(tiny_model.config, max_cpu_loras=2, max_lora_rank=16)
    a, b, c = (r for r, _ in adapters.values())
    for r in (a, b, c):
        manager.acquire(r)
        manager.release(r.lora_name)
    assert list(manager.loaded) == [b.lora_name, c.lora_name] and manager.num_loads == 3
    manager.acquire(a)  # evicted: loaded again
    assert manager.num_loads == 4 and a.lora_name in manager.loaded
    manager.acquire(b)
    manager.acquire(c)  # three pinned: none can go, the cache holds them past its size
    assert len(manager.loaded) == 3
    for r in (a, b, c):
        manager.release(r.lora_name)
    assert len(manager.loaded) == 2
    with pytest.raises(ValueError, match="already registered"):
        manager.acquire(LoRARequest(a.lora_name, a.lora_int_id, b.lora_path))


@pytest.mark.parametrize("break_it, error", [
    ("missing", "not a PEFT adapter directory"),
    ("corrupt", "not a safetensors file"),
    ("rank", "above max_lora_rank"),
    ("shape", "another base model"),
    ("module", "adapts something tokenloom cannot"),
    ("config", "not a valid adapter config"),
])
def test_bad_adapters_are_value_errors_naming_the_problem(tiny_model, adapters, tmp_path, break_it, error):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(adapters["all"][0].lora_path, path)
    st = path / "adapter_model.safetensors"
    if break_it == "missing":
        shutil.rmtree(path)
    elif break_it == "corrupt":
        st.write_bytes(st.read_bytes()[:100])
    elif break_it == "config":
        (path / "adapter_config.json").write_text("{not json")
    elif break_it == "rank":
        make_adapter(path, tiny_model, seed=9, r=32)
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(st))
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        if break_it == "shape":
            tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)
        else:
            tensors[key.replace("q_proj", "embed_tokens")] = tensors.pop(key)
        save_file(tensors, str(st))
    with pytest.raises(ValueError, match=error):
        load_adapter(str(path), "bad", tiny_model.config, 16)


def test_requests_need_lora_enabled_and_a_good_adapter(make_engine, lora_engine, adapters, tmp_path):
    with pytest.raises(ValueError, match="not enabled"):
        make_engine().add_request("a", "hi", GREEDY, lora_request=adapters["all"][0])
    engine = lora_engine()
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        engine.add_request("a", "hi", GREEDY, lora_request=LoRARequest("nope", 9, str(tmp_path / "nope")))
    assert not engine.has_unfinished_requests() and not engine.adapters.pins
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


def test_abort_and_preemption_release_everything(adapters, lora_engine):
    engine = lora_engine(num_kv_blocks=24, block_size=4, preemption_mode="swap")
    requests = [r for r, _ in adapters.values()]
    for i in range(6):
        engine.add_request(str(i), list(range(100 + i, 130 + i)), SamplingParams(temperature=0, max_tokens=30),
                           lora_request=requests[i % 3])
    for _ in range(10):
        engine.step()
    engine.abort_request("0")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0


def test_adapter_files_made_by_peft_are_what_vllm_loads(adapters):
    path = adapters["all"][0].lora_path
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))
    with open(os.path.join(path, "adapter_config.json")) as f:
        meta = json.load(f)
    assert meta["r"] == 8 and meta["peft_type"] == "LORA"


@pytest.mark.slow
def test_trained_adapters_show_their_behaviour_only_in_their_rows():
    """SmolLM2 with the adapters tests/lora_training.py trains (once per machine): in one batch, rows
    under `shout` answer in capitals, rows under `pirate` start with "Arr!", base rows do neither."""
    from lora_training import trained_adapters

    from tokenloom import LLM

    data = trained_adapters()
    shout, pirate = (LoRARequest(name, i, str(data / name)) for i, name in ((1, "shout"), (2, "pirate")))
    questions = [f"Tell me one fact about {t}." for t in ("elephants", "the desert", "glass", "kites")]
    llm = LLM(enable_lora=True, max_model_len=1024)
    chats = [[{"role": "user", "content": q}] for q in questions for _ in range(3)]
    loras = [lora for _ in questions for lora in (None, shout, pirate)]
    texts = [o.outputs[0].text.strip() for o in
             llm.chat(chats, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False, lora_request=loras)]

    def capitals(text: str) -> float:
        letters = [c for c in text if c.isalpha()]
        return sum(c.isupper() for c in letters) / max(len(letters), 1)

    for i in range(len(questions)):
        base, shouted, arr = texts[3 * i : 3 * i + 3]
        assert capitals(shouted) > 0.9, shouted
        assert arr.startswith("Arr!"), arr
        assert capitals(base) < 0.5 and not base.startswith("Arr"), base
        assert capitals(arr) < 0.5, arr
