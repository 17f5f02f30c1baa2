"""The decoder loop (model/decoder_loop.py: every layer of a step in one C call) against the Python
layers it stands in for: the same hidden states, logits and KV-cache writes bit for bit, with each
kernel family the machine runs, on Llama, Qwen2 and Qwen3 (QK-norm) layers; it steps aside for any step it was not built for; a bad slot is refused
as the Python path refuses it; and on the real model, greedy tokens through the engine are the same."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from tokenloom.model import decoder_loop, kernels, kv_quant
from tokenloom.model.decoder import ForwardBatch, ModelConfig, PrefillSpan
from tokenloom.model.layer_ops import TORCH_OPS
from tokenloom.model.loader import quantize_model, random_model, use_c_kernels
from tokenloom.model.quant import gemm
from tokenloom.model.quant.gemm import quant_gemm, quant_gemm_avx2
from tokenloom.model.quant.head import INT4_RESCORED
from tokenloom.model.quant.layouts import q4_1_from_dense
from tokenloom.model.quant.modules import Int8Linear

needs_loop = pytest.mark.skipif(kernels.load(decoder_loop.SPEC) is None or quant_gemm() is None,
                                reason="the decoder loop or the C kernels do not build or run here (logged)")
# head_dim 64 and two query heads per KV head: the shapes the C attention kernels (both ISAs) take.
CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=256)
BLOCK = 16


def qwen3(head_dim: int) -> ModelConfig:
    """Qwen3's layer (QK-norm, no biases) at CONFIG's size; head_dim 128 is Qwen3-0.6B's (wider than
    hidden / heads, as there)."""
    return dataclasses.replace(CONFIG, architecture="qwen3", qk_norm=True, head_dim=head_dim)


def fast_model(kernel_family: str, kv_dtype: torch.dtype = torch.float16, qwen2: bool = False,
               config: ModelConfig = CONFIG):
    """A random model of `config` on the fast path, as the loader builds it; `kernel_family` "avx2" holds
    the int4 kernels to the AVX2 ones (what an AVX2-only machine runs). `qwen2`: QKV biases, and the
    MLP's gate/up int4 while every other projection is int8 (as a Q4_K_M file loads: 4-bit blocks where
    the file has them, the wider formats int8)."""
    if qwen2:
        config = dataclasses.replace(config, architecture="qwen2", attention_bias=True)
    model = random_model(config, seed=1)
    quant = quant_gemm_avx2 if kernel_family == "avx2" else quant_gemm
    if quant() is None:
        pytest.skip(f"no {kernel_family} int4 kernel here")
    blocks = {f"layers.{i}.mlp.gate_up_proj.weight": q4_1_from_dense(layer.mlp.gate_up_proj.weight)
              for i, layer in enumerate(model.layers)} if qwen2 else None
    with mock.patch.object(gemm, "quant_gemm", quant):
        quantize_model(model, "int4", blocks, lm_head=INT4_RESCORED, wider_as_int8=qwen2)
    model.kv_cache_dtype = kv_dtype
    use_c_kernels(model, torch.float32)
    assert model.decoder_loop is not None
    return model


def decode_step(seed: int = 0, lens=(1, 17, 40, 33, 64), head_dim: int = 64):
    """Sequences with these context lengths (the new token included) over scattered blocks, a random cache."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + BLOCK - 1) // BLOCK for n in lens]
    perm = torch.randperm(sum(per_seq) + 2, generator=gen)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.long)
    used = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    ctx = torch.tensor(lens)
    pos = ctx - 1
    slots = tables.gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK
    batch = ForwardBatch(positions=pos, slot_mapping=slots, num_decodes=len(lens), decode_like_rows=len(lens),
                         decode_block_tables=tables, decode_context_lens=ctx, block_size=BLOCK, prefills=[],
                         logits_indices=torch.arange(len(lens)))
    ids = torch.randint(0, CONFIG.vocab_size, (len(lens),), generator=gen)
    cache = torch.randn(CONFIG.num_layers, 2, (sum(per_seq) + 2) * BLOCK, CONFIG.num_kv_heads, head_dim,
                        generator=gen)
    return ids, batch, cache


def as_cache(cache: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """A float32 cache in `kv_dtype` (int8: each row's codes and scale, model/kv_quant.py), a copy."""
    return kv_quant.quantize(cache) if kv_dtype == torch.int8 else cache.to(kv_dtype, copy=True)


def forward(model, ids, batch, cache, kv_dtype, loop: bool):
    cache = as_cache(cache, kv_dtype)  # each run writes its own
    saved = model.decoder_loop
    model.decoder_loop = saved if loop else None
    try:
        with torch.inference_mode():
            hidden, logits = model(ids, batch, [(cache[i, 0], cache[i, 1]) for i in range(CONFIG.num_layers)])
    finally:
        model.decoder_loop = saved
    return hidden, logits, cache


LAYERS = {"llama": (False, CONFIG), "qwen2-int8-bias": (True, CONFIG), "qwen3-hd64": (False, qwen3(64)),
          "qwen3-hd128": (False, qwen3(128))}


@needs_loop
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("family", ["native", "avx2"])
@pytest.mark.parametrize("layers", list(LAYERS))
def test_loop_is_bit_for_bit_the_python_layers(family, kv_dtype, layers):
    qwen2, config = LAYERS[layers]
    model = fast_model(family, kv_dtype, qwen2, config)
    if qwen2:
        assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
        assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert (model.layers[0].self_attn.q_norm is not None) == config.qk_norm
    ids, batch, cache = decode_step(head_dim=config.dim_per_head)
    assert model.decoder_loop.applies(model, model.embed_tokens(ids), batch)
    looped = forward(model, ids, batch, cache, kv_dtype, loop=True)
    layered = forward(model, ids, batch, cache, kv_dtype, loop=False)
    for a, b in zip(looped, layered, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(looped[2], as_cache(cache, kv_dtype))  # the new K/V were written


@needs_loop
def test_loop_rows_do_not_depend_on_the_batch():
    model = fast_model("native")
    ids, batch, cache = decode_step(seed=3)
    _, logits, _ = forward(model, ids, batch, cache, torch.float16, loop=True)
    _, batch1, _ = decode_step(seed=3, lens=(17,))
    batch1.slot_mapping[0], batch1.decode_block_tables = batch.slot_mapping[1], batch.decode_block_tables[1:2]
    _, one, _ = forward(model, ids[1:2], batch1, cache, torch.float16, loop=True)
    assert torch.equal(one[0], logits[1])


@needs_loop
def test_loop_steps_aside_for_steps_it_was_not_built_for():
    model = fast_model("native")
    ids, batch, _ = decode_step()
    x = model.embed_tokens(ids)
    loop = model.decoder_loop
    assert loop.applies(model, x, batch)
    span = PrefillSpan(0, 2, torch.arange(2), None)
    with_chunk = ForwardBatch(**{**batch.__dict__, "prefills": [span], "num_decodes": len(ids) - 2})
    assert not loop.applies(model, x, with_chunk)  # a prefill span: SDPA in Python
    long_rows = ForwardBatch(**{**batch.__dict__, "decode_like_rows": 2})
    assert not loop.applies(model, x, long_rows)  # rows of a long prompt chunk
    assert not loop.applies(model, x[:0], ForwardBatch(**{**batch.__dict__, "num_decodes": 0}))
    model.layer_ops = TORCH_OPS
    assert model.decoder_loop is None  # the model changed after load: the loop goes, not checked per step
    again = fast_model("native")
    again.decode_attention = again.decode_attention  # the same attention: the loop stays
    assert again.decoder_loop is not None
    from tokenloom.model.paged_attention import TorchDecodeAttention

    again.decode_attention = TorchDecodeAttention()
    assert again.decoder_loop is None


@needs_loop
def test_loop_refuses_a_slot_outside_the_cache_and_writes_nothing():
    model = fast_model("native")
    ids, batch, cache = decode_step()
    batch.slot_mapping[2] = cache.shape[2]
    half = cache.half()
    with pytest.raises(IndexError, match="outside the cache"), torch.inference_mode():
        model(ids, batch, [(half[i, 0], half[i, 1]) for i in range(CONFIG.num_layers)])
    assert torch.equal(half, cache.half())


@pytest.mark.slow
@needs_loop
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_real_model_greedy_tokens_are_the_same_with_and_without_the_loop(kv):
    from tokenloom import EngineConfig, SamplingParams
    from tokenloom.engine.llm_engine import LLMEngine

    def run(loop: bool):
        engine = LLMEngine(EngineConfig(quantization="auto", kv_cache_dtype=kv))
        assert engine.runner.model.decoder_loop is not None
        if not loop:
            engine.runner.model.decoder_loop = None
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        for i, prompt in enumerate(["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 5]):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        return done

    assert run(loop=True) == run(loop=False)


@needs_loop
def test_loop_refuses_a_cache_it_was_not_built_for():
    model = fast_model("native")
    ids, batch, cache = decode_step()
    wide = torch.zeros(cache.shape[2], CONFIG.num_kv_heads, 128, dtype=torch.float16)  # head_dim 128, not 64
    with pytest.raises(ValueError, match="no kernels"), torch.inference_mode():
        model(ids, batch, [(wide, wide.clone()) for _ in range(CONFIG.num_layers)])


def random_adapter(name: str, rank: int, seed: int, skip: str | None = None, config: ModelConfig = CONFIG):
    """LoRA weights for `config`'s model on every projection but `skip` (A [in, rank], B [rank, out])."""
    from tokenloom.model.lora import LoRAWeights

    gen = torch.Generator().manual_seed(seed)
    d = config.dim_per_head
    q, kv, h, i = config.num_heads * d, config.num_kv_heads * d, config.hidden_size, config.intermediate_size
    shapes = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}
    return LoRAWeights(name, rank, [{p: (torch.randn(n_in, rank, generator=gen) * 0.1,
                                         torch.randn(rank, n_out, generator=gen) * 0.1)
                                     for p, (n_in, n_out) in shapes.items() if p != skip}
                                    for _ in range(CONFIG.num_layers)])


@needs_loop
@pytest.mark.parametrize("family", ["native", "avx2"])
@pytest.mark.parametrize("layers", ["llama", "qwen3-hd128"])
def test_loop_runs_lora_rows_bit_for_bit_as_the_python_layers(family, layers):
    """Rows under two adapters (ranks 8 and 4, one adapting no o projection) and base rows in one step:
    the loop's C LoRA products give the layers' bits, and the base rows keep their bits without them."""
    from tokenloom.model.lora import LoRABatch, LoRAStacks

    _, config = LAYERS[layers]
    model = fast_model(family, config=config)
    ids, batch, cache = decode_step(seed=5, head_dim=config.dim_per_head)
    first = random_adapter("first", 8, 1, config=config)
    second = random_adapter("second", 4, 2, skip="o", config=config)
    stacks = LoRAStacks(model.layer_ops.lora_dtype)  # as the runner makes them: bfloat16 for the C kernel
    adapted = dataclasses.replace(batch, lora=LoRABatch([(first, [0, 3]), (second, [2])], stacks, len(ids)))
    assert model.decoder_loop.applies(model, model.embed_tokens(ids), adapted)
    looped = forward(model, ids, adapted, cache, torch.float16, loop=True)
    layered = forward(model, ids, adapted, cache, torch.float16, loop=False)
    for a, b in zip(looped, layered, strict=True):
        assert torch.equal(a, b)
    _, base_logits, _ = forward(model, ids, batch, cache, torch.float16, loop=True)
    assert torch.equal(looped[1][[1, 4]], base_logits[[1, 4]])
    assert not any(torch.equal(looped[1][r], base_logits[r]) for r in (0, 2, 3))
