"""The int8 KV cache (`--kv-cache-dtype int8`, model/kv_quant.py): the KV write and the paged attention
kernels against float32, batch invariance, the cache's sizing, the plan, the engine's block moves (prefix
cache, swap, disaggregated transfer) and quality against a float16 cache on the bundled model."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import KERNELS, LIB, kernel_for, random_case, rows_case

from tokenloom.model import kernels, kv_quant, layer_ops
from tokenloom.model import paged_attention as pa

OPS_LIB = kernels.load(layer_ops.SPEC)
needs_c = pytest.mark.skipif(LIB is None or OPS_LIB is None, reason="the C kernels do not build or run here (logged)")


def int8_cache(x: torch.Tensor) -> torch.Tensor:
    return kv_quant.quantize(x)


@needs_c
def test_the_c_kv_write_is_torchs_quantize_bit_for_bit():
    """Rows of several magnitudes (and a row of zeros: scale 0) into scattered slots: the C write and the
    torch one give the same bytes, and each value comes back within half its row's step."""
    gen = torch.Generator().manual_seed(0)
    slots_n, kv_heads, head_dim, rows = 64, 3, 64, 40
    k = torch.randn(rows, kv_heads, head_dim, generator=gen) * torch.logspace(-3, 2, rows)[:, None, None]
    v = torch.randn(rows, kv_heads, head_dim, generator=gen)
    k[5] = 0
    slots = torch.randperm(slots_n, generator=gen)[:rows]
    caches = [torch.zeros(slots_n, kv_heads, head_dim + kv_quant.SCALE_BYTES, dtype=torch.int8) for _ in range(4)]
    layer_ops.CLayerOps(OPS_LIB).write_kv(k, v, slots, caches[0], caches[1])
    layer_ops.TORCH_OPS.write_kv(k, v, slots, caches[2], caches[3])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    for cache, x in ((caches[0], k), (caches[1], v)):
        back = kv_quant.dequantize(cache[slots])
        step = x.abs().amax(-1, keepdim=True) / 127
        assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(kv_quant.dequantize(caches[0][slots[5]]), torch.zeros(kv_heads, head_dim))


@needs_c
def test_the_c_kv_write_refuses_a_cache_without_room_for_the_scales():
    k = torch.randn(2, 3, 64)
    cache = torch.zeros(8, 3, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 cache"):
        layer_ops.CLayerOps(OPS_LIB).write_kv(k, k, torch.tensor([0, 1]), cache, cache.clone())


@needs_c
@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 4),
                                                               (8, 2, 64, 16), (8, 1, 64, 8)])
def test_int8_attention_against_float32(heads, kv_heads, head_dim, block_size, which):
    """The int8 kernels read code * scale: the float32 kernel's bits over the dequantized cache, torch's
    gather + SDPA over the int8 cache within float rounding, and the float32 reference over the
    unquantized K/V within int8's error."""
    q, k, v, tables, lens = random_case(7, heads, kv_heads, head_dim, block_size, seed=heads)
    lens[0] = (lens[0] + block_size - 1) // block_size * block_size
    k8, v8 = int8_cache(k), int8_cache(v)
    kernel, torch_impl = kernel_for(which), pa.TorchDecodeAttention()
    prepared = kernel.prepare(tables, lens, block_size)
    out = kernel(prepared, q, k8, v8, 0.125)
    assert torch.equal(out, kernel(prepared, q, kv_quant.dequantize(k8), kv_quant.dequantize(v8), 0.125))
    torch_out = torch_impl(torch_impl.prepare(tables, lens, block_size), q, k8, v8, 0.125)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    exact = torch_impl(torch_impl.prepare(tables, lens, block_size), q, k, v, 0.125)
    err = (out - exact).abs().max().item()
    assert err < 0.03, err  # K/V ~ N(0, 1): a step of ~max|x| / 127 ~ 0.025 per value, averaged over the context


@needs_c
@pytest.mark.parametrize("which", KERNELS)
def test_int8_rows_do_not_depend_on_the_batch(which):
    """A prompt's rows sharing tasks, decode rows, a shared prefix, contexts past the stack buffer: each
    row's bits are the ones it gets alone."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    k = int8_cache(torch.randn(160 * bs, kv_heads, head_dim, generator=gen))
    v = int8_cache(torch.randn(160 * bs, kv_heads, head_dim, generator=gen))
    perm = torch.randperm(160, generator=gen)
    prompt, other, shared = perm[:40], perm[40:60], torch.cat([perm[:3], perm[60:70]])
    rows = [(prompt, c) for c in range(570, 590)] + [(shared, c) for c in (5, 48, 150)]
    rows += [(other, 37), (other, 301), (prompt, 3), (prompt, 1)]
    tables, lens, q = rows_case(rows, heads, head_dim, gen)
    kernel = kernel_for(which)
    full = kernel(kernel.prepare(tables, lens, bs), q, k, v, 0.125)
    for r in range(len(rows)):
        one = kernel(kernel.prepare(tables[r : r + 1], lens[r : r + 1], bs), q[r : r + 1], k, v, 0.125)
        assert torch.equal(one, full[r : r + 1]), r


@needs_c
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (16, 8, 128), (12, 2, 128)])
def test_the_avx2_and_avx512_int8_kernels_agree(heads, kv_heads, head_dim):
    """SmolLM2's, Qwen2.5-0.5B's, Qwen3-0.6B's and Qwen2.5-1.5B's heads, contexts past the stack buffer."""
    from test_paged_attention import LIB512

    if LIB512 is None:
        pytest.skip("no AVX-512 kernel here")
    q, k, v, tables, lens = random_case(5, heads, kv_heads, head_dim, 16, seed=3, max_len=600)
    k8, v8 = int8_cache(k), int8_cache(v)
    a, b = kernel_for(None), kernel_for("avx512")
    torch.testing.assert_close(a(a.prepare(tables, lens, 16), q, k8, v8, 0.125),
                               b(b.prepare(tables, lens, 16), q, k8, v8, 0.125), rtol=1e-5, atol=1e-5)


def test_int8_blocks_hold_about_twice_float16s_tokens():
    """kv_cache_size and kv-calc count the scales: SmolLM2 (head_dim 64) holds 64 / 34 as many tokens in
    int8 as in float16 at the same bytes."""
    from tokenloom.config import EngineConfig
    from tokenloom.engine.kv_cache import kv_cache_size
    from tokenloom.model.config import ModelConfig
    from tokenloom.sim import kv_calc

    cfg = ModelConfig(vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3)
    config = EngineConfig(kv_cache_memory_bytes=1 << 30, block_size=16, preemption_mode="swap", swap_space=1)
    f16 = kv_cache_size(config, cfg, torch.float16)
    i8 = kv_cache_size(config, cfg, torch.int8)
    assert i8[2] == 2 * 30 * 16 * 3 * (64 + 4)  # bytes per block: codes and scales of K and V
    assert f16[2] == 2 * 30 * 16 * 3 * 64 * 2
    assert i8[0] == (1 << 30) // i8[2] and i8[1] == (1 << 30) // i8[2]
    assert 1.85 < i8[0] / f16[0] < 1.9  # 128 / 68
    from tokenloom.sim.fleet import kv_bytes_per_token

    assert kv_bytes_per_token(cfg, EngineConfig(quantization="int4", kv_cache_dtype="int8")) * 16 == i8[2]
    assert kv_bytes_per_token(cfg, EngineConfig(quantization="int4")) * 16 == f16[2]  # auto: float16
    shape = kv_calc.load_model_shape("llama-3-8b", "int8")
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4)
    assert shape.kv_bytes_per_token * 16 == kv_calc.load_model_shape("llama-3-8b", "fp16").kv_bytes_per_token * 16 * 132 // 256


def test_the_plan_takes_int8_kv_on_the_c_path_and_torch_reads_it_too():
    from tokenloom.config import EngineConfig
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.plan import kv_cache_dtype_for, plan_forward

    assert kv_cache_dtype_for("int4", "float32", "int8") == "int8"
    assert kv_cache_dtype_for("int4", "float32") == "float16" and kv_cache_dtype_for("none", "float32") == "float32"
    assert EngineConfig(kv_cache_dtype="int8").validate().kv_cache_dtype == "int8"
    cfg = ModelConfig(vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                      num_kv_heads=3)
    plan = plan_forward(EngineConfig(quantization="int4", kv_cache_dtype="int8"), cfg)
    assert plan.kv_cache == "int8"
    if LIB is not None and OPS_LIB is not None:
        assert plan.attention.name.startswith("paged-c") and plan.layer_ops.name == "c", plan.line()
    exact = plan_forward(EngineConfig(quantization="none", kv_cache_dtype="int8"), cfg)
    assert exact.kv_cache == "int8" and exact.attention.name == "torch" and exact.layer_ops.name == "torch"


def int8_engine(tokenizer, c_kernels: bool = True, **kw):
    """A small random model on the C kernels (or torch's ops) over an int8 cache, in an engine."""
    from tokenloom import EngineConfig
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model, use_c_kernels

    cfg = ModelConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512)
    model = random_model(cfg, seed=3)
    model.kv_cache_dtype = torch.int8
    if c_kernels:
        use_c_kernels(model, torch.float32)  # dense weights: no decoder loop (tests/test_decoder_loop.py has it)
    config = EngineConfig(kv_cache_dtype="int8", max_num_batched_tokens=64, **({"num_kv_blocks": 64} | kw))
    return LLMEngine(config, model=model, tokenizer=tokenizer)


def run_all(engine, prompts, max_tokens=12):
    from test_fast_paths import run_requests

    from tokenloom import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return run_requests(engine, [{"prompt_token_ids": p} for p in prompts], params)


PROMPTS = [list(range(100 + 7 * i, 140 + 11 * i)) for i in range(6)]


@needs_c
def test_an_int8_cache_serves_batch_invariant_greedy_with_prefix_hits_swap_and_transfer(tokenizer):
    """Greedy tokens over an int8 cache: a request's tokens alone equal its tokens in a batch, after a
    prefix-cache hit, after being swapped out and in (scales move with their blocks), and on an engine
    that imported another engine's K/V (disaggregated transfer)."""
    from conftest import assert_engine_clean

    engine = int8_engine(tokenizer)
    assert engine.runner.kv_cache.dtype == torch.int8 and engine.runner.kv_cache.shape[-1] == 32 + 4
    alone = []
    for p in PROMPTS:
        engine.kv.reset_prefix_cache()
        alone += run_all(engine, [p])
    engine.kv.reset_prefix_cache()
    assert run_all(engine, PROMPTS) == alone  # batch-invariant
    hits = engine.kv.prefix_hits
    assert run_all(engine, PROMPTS) == alone and engine.kv.prefix_hits > hits  # from the prefix cache
    assert_engine_clean(engine)

    tight = int8_engine(tokenizer, num_kv_blocks=14, preemption_mode="swap", enable_prefix_caching=False)
    assert run_all(tight, PROMPTS, max_tokens=40) == run_all(engine, PROMPTS, max_tokens=40)
    assert tight.scheduler.num_preemptions > 0 and tight.runner.host_cache.dtype == torch.int8
    assert_engine_clean(tight)

    prefill, decode = int8_engine(tokenizer), int8_engine(tokenizer)
    run_all(prefill, [PROMPTS[5]], max_tokens=1)
    tokens, kv = prefill.export_prefix_kv(PROMPTS[5])
    assert tokens > 0 and kv.dtype == torch.int8 and kv.shape[-1] == 32 + 4
    assert decode.import_prefix_kv(PROMPTS[5], kv) == tokens
    assert run_all(decode, [PROMPTS[5]]) == [alone[5]] and decode.kv.prefix_hits == tokens


def test_torchs_path_reads_and_writes_the_same_int8_cache(tokenizer):
    """The torch ops (the exact path's, and what long prompt chunks read through) quantize on write and
    dequantize on gather: the same greedy tokens as the C kernels over an int8 cache."""
    engine = int8_engine(tokenizer, c_kernels=False)
    assert engine.model.layer_ops.name == "torch" and engine.model.decode_attention.name == "torch"
    got = run_all(engine, PROMPTS)
    if LIB is not None and OPS_LIB is not None:
        assert got == run_all(int8_engine(tokenizer), PROMPTS)


@pytest.mark.slow
def test_int8_kv_quality_against_float16_kv_on_smollm2(tokenizer):
    """The serving default (int4 weights) over an int8 cache against the same over a float16 one,
    teacher-forced on natural text: the prompt's K/V are written and read back through the cache."""
    from test_fast_paths import natural_text, teacher_forced_logprobs

    from tokenloom.model.load import model_path
    from tokenloom.model.loader import ModelSource, load_model

    source = ModelSource.resolve(model_path(None))
    f16 = load_model(source, quantization="int4")
    i8 = load_model(source, quantization="int4", kv_cache_dtype="int8")
    assert f16.kv_cache_dtype == torch.float16 and i8.kv_cache_dtype == torch.int8
    assert "int8 KV cache" in i8.plan.line() and i8.plan.decoder_loop.name == f16.plan.decoder_loop.name
    ids = torch.tensor(tokenizer.encode(natural_text()))
    assert ids.numel() >= 2000, ids.numel()
    ref, got = teacher_forced_logprobs(f16, ids), teacher_forced_logprobs(i8, ids)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    print(f"int8 KV vs float16 KV: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats over {ids.numel()} positions")
    assert kl <= 0.02, (top1, kl)
    if top1 < 0.98 and "avx512" not in i8.plan.attention.name:
        # Measured on an AVX2-only Zen 3: top-1 0.9784, KL 0.0017 (issue 58); the AVX-512 kernel meets 98%.
        assert top1 >= 0.97, (top1, kl)  # no worse than that
        pytest.xfail(f"int8 KV through the AVX2 attention kernel: top-1 {top1:.4f} < 0.98 (KL {kl:.4f})")
    assert top1 >= 0.98, (top1, kl)
