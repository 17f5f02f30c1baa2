"""The C layer ops (model/layer_ops.py) against the torch ones: RMSNorm and RoPE within float32 rounding,
the KV write bit for bit, every op row-invariant (the OpenMP-split batches included), a bad slot refused
before anything is written, and a whole model forward that matches the torch ops."""

from __future__ import annotations

import pytest
import torch

from tokenloom.model import kernels
from tokenloom.model import layer_ops as lo

LIB = kernels.load(lo.SPEC)
pytestmark = pytest.mark.skipif(LIB is None, reason="the C layer ops do not build or run here (logged)")
TORCH = lo.TorchLayerOps()


@pytest.fixture(scope="module")
def c_ops():
    return lo.CLayerOps(LIB)


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the OpenMP-split path
def test_rms_norm_matches_torch_and_is_row_invariant(c_ops, rows, monkeypatch):
    x, w = torch.randn(rows, 580) * 3, torch.rand(580) + 0.5  # 580: a tail after the 8-wide loop
    ref = TORCH.rms_norm(x, w, 1e-5)
    no_fallback(monkeypatch)
    out = c_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out, torch.cat([c_ops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(rows)]))


@pytest.mark.parametrize("rows", [1, 3, 65])
def test_rope_matches_torch_in_place_on_the_fused_projection(c_ops, rows, monkeypatch):
    """Q and K heads are rotated where they sit in the QKV output; V (after them) is untouched."""
    heads, kv_heads, hd = 4, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd)
    theta = torch.rand(rows, 1, hd // 2) * 6
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * hd].view(rows, -1, hd)
    ref = TORCH.rope(qk.clone(), cos, sin)
    no_fallback(monkeypatch)
    out = c_ops.rope(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * hd :], before[:, (heads + kv_heads) * hd :])
    one = before[:1].clone()
    c_ops.rope(one[:, : (heads + kv_heads) * hd].view(1, -1, hd), cos[:1], sin[:1])
    assert torch.equal(one, qkv[:1])


@pytest.mark.parametrize("rows", [1, 3, 20])  # 20: the OpenMP-split path
def test_silu_mul_matches_torch_and_is_row_invariant(c_ops, rows, monkeypatch):
    gate_up = torch.randn(rows, 2 * 1540) * 6  # 1540: a tail after the 8-wide loop; large |g| too
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    ref = TORCH.silu_mul(gate_up)
    no_fallback(monkeypatch)
    out = c_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    assert torch.equal(out, torch.cat([c_ops.silu_mul(gate_up[i : i + 1]) for i in range(rows)]))


def no_fallback(monkeypatch):
    """Make the torch ops fail inside a test: the C path must take these shapes itself."""
    def boom(*args, **kwargs):
        raise AssertionError("fell back to the torch op")

    for name in ("rms_norm", "rope", "silu_mul", "write_kv"):
        monkeypatch.setattr(lo.TorchLayerOps, name, boom)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 6])
def test_kv_write_is_the_torch_cast_bit_for_bit(c_ops, cache_dtype, rows, monkeypatch):
    """K and V as the model passes them: strided views of the fused projection (V's rows at another
    stride than K's when a step has one row, as torch's views then report)."""
    kv_heads, hd, num_slots = 3, 64, 40
    qkv = torch.randn(rows, 9 * hd + 2 * kv_heads * hd) * 100  # large values: float16 rounding matters
    k = qkv[:, 9 * hd : 12 * hd].view(rows, kv_heads, hd)
    v = torch.randn(rows, kv_heads * hd * 2)[:, : kv_heads * hd].view(rows, kv_heads, hd) * 100
    slots = torch.tensor([7, 0, 39, 12, 7, 3][:rows])  # a repeated slot, as padding rows repeat theirs
    if rows > 4:
        v[4], k[4] = v[0], k[0]
    caches = [[torch.zeros(num_slots, kv_heads, hd, dtype=cache_dtype) for _ in range(2)] for _ in range(2)]
    TORCH.write_kv(k, v, slots, *caches[0])
    no_fallback(monkeypatch)
    c_ops.write_kv(k, v, slots, *caches[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_kv_write_refuses_a_slot_outside_the_cache(c_ops):
    k = v = torch.randn(2, 3, 64)
    k_cache, v_cache = torch.zeros(10, 3, 64, dtype=torch.float16), torch.zeros(10, 3, 64, dtype=torch.float16)
    for bad in (10, -1):
        with pytest.raises(IndexError, match="outside the cache"):
            c_ops.write_kv(k, v, torch.tensor([0, bad]), k_cache, v_cache)
    assert not k_cache.any() and not v_cache.any()


def test_other_dtypes_are_an_error_not_a_quiet_torch_op(c_ops):
    x, w = torch.randn(3, 64).bfloat16(), torch.rand(64).bfloat16()
    with pytest.raises(ValueError, match="rms_norm takes float32"):
        c_ops.rms_norm(x, w, 1e-5)
    k = v = torch.randn(2, 3, 64)
    caches = [torch.zeros(10, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="write_kv takes"):
        c_ops.write_kv(k, v, torch.tensor([0, 1]), *caches)


def test_a_model_forward_with_c_ops_matches_the_torch_ops(tokenizer, monkeypatch):
    from tokenloom import EngineConfig, SamplingParams
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model

    cfg = ModelConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512)
    outputs, logits = [], []
    for ops in (TORCH, lo.CLayerOps(LIB)):
        model = random_model(cfg, seed=5)
        model.layer_ops = ops
        assert model.layers[1].self_attn.ops is ops and model.norm.ops is ops
        if ops is not TORCH:
            no_fallback(monkeypatch)  # every op of the step, prefill and decode, takes the C path
        forward = model.forward

        def spy(ids, batch, kv, forward=forward):
            out = forward(ids, batch, kv)
            logits.append(out[1])
            return out

        model.forward = spy
        engine = LLMEngine(EngineConfig(max_num_batched_tokens=64, num_kv_blocks=64, kv_cache_dtype="float16"),
                           model=model, tokenizer=tokenizer)
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request("a", list(range(100, 120)), greedy)
        engine.add_request("b", list(range(300, 345)), greedy)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outputs.append(done)
    half = len(logits) // 2
    for a, b in zip(logits[:half], logits[half:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("rank,n", [(16, 96), (5, 37), (24, 8)])
def test_lora_add_matches_the_batched_products_row_by_row(c_ops, rank, n):
    """The C LoRA kernel (bfloat16 A and B, float32 sums) against (x A) B in float64: rows under either adapter get their own adapter's
    product, rows with slot -1 are untouched, and a row's bits are the same alone as in the batch, in
    tiles of 1 to 4 rows (ranks and widths that are not multiples of eight take the kernel's tails)."""
    gen = torch.Generator().manual_seed(rank)
    rows, k, adapters = 11, 40, 2
    x = torch.randn(rows, k, generator=gen)
    a = (torch.randn(adapters, k, rank, generator=gen) * 0.2).bfloat16()  # the stacks' dtype on this path
    b = (torch.randn(adapters, rank, n, generator=gen) * 0.2).bfloat16()
    y0 = torch.randn(rows, n, generator=gen)
    slots = torch.tensor([1, -1, 0, 0, -1, 1, 0, 0, 0, 1, 0])  # adapter 0's six rows: a tile of four and one of two
    y = y0.clone()
    assert c_ops.lora_add(x, y, slots, a, b)
    for r in range(rows):
        s = int(slots[r])
        want = y0[r].double() + (x[r].double() @ a[s].double() @ b[s].double() if s >= 0 else 0)
        torch.testing.assert_close(y[r].double(), want, rtol=1e-5, atol=1e-5)
        alone = y0[r : r + 1].clone()
        c_ops.lora_add(x[r : r + 1], alone, slots[r : r + 1], a, b)
        assert torch.equal(alone[0], y[r])
    assert not c_ops.lora_add(x, y.t(), slots, a, b)  # not a layout it takes: the caller's bmm runs
    assert not c_ops.lora_add(x, y, slots, a.float(), b.float())  # nor float32 stacks
    assert not lo.TORCH_OPS.lora_add(x, y, slots, a, b)
