"""The paged decode-attention kernel (model/paged_attention.py) against the gather + SDPA path: same
values on random paged caches (GQA, shuffled block tables, ragged contexts), and a row's result does not
depend on the other rows."""

from __future__ import annotations

import pytest
import torch

from tokenloom.model import kernels, kv_quant
from tokenloom.model import paged_attention as pa

LIB = pa.load_kernel()
LIB512 = kernels.load(pa.SPEC_AVX512)
needs_kernel = pytest.mark.skipif(LIB is None, reason="the C kernel does not build or run here (logged)")
# Each kernel the machine runs: AVX2 alone, and with the AVX-512 one (head_dim 64 to 256, GQA groups up to 8).
KERNELS = [pytest.param(None, id="avx2"),
           pytest.param("avx512", id="avx512", marks=pytest.mark.skipif(LIB512 is None, reason="no AVX-512 kernel here"))]


def kernel_for(name):
    return pa.PagedDecodeAttention(LIB, LIB512 if name == "avx512" else None)


def random_case(num_seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int,
                max_len: int = 90):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (num_seqs,), generator=gen)
    blocks_per_seq = [(int(n) + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)  # blocks scattered across the cache
    tables = torch.zeros(num_seqs, max(blocks_per_seq), dtype=torch.long)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    return q, k, v, tables, lens



def assert_close_to_torch_and_rows_alone(kernel, tables, lens, bs, q, k, v) -> None:
    """The kernel's output is torch's reference within float error, and each row's bits are its own:
    the same alone as among the others."""
    ref_impl = pa.TorchDecodeAttention()
    out = kernel(kernel.prepare(tables, lens, bs), q, k, v, 0.125)
    torch.testing.assert_close(out, ref_impl(ref_impl.prepare(tables, lens, bs), q, k, v, 0.125), rtol=1e-5, atol=1e-5)
    for r in range(len(lens)):
        one = kernel(kernel.prepare(tables[r : r + 1], lens[r : r + 1], bs), q[r : r + 1], k, v, 0.125)
        assert torch.equal(one, out[r : r + 1]), r

@needs_kernel
@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 4),
                                                               (8, 2, 64, 16), (8, 1, 64, 8)])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, head_dim, block_size, kv_dtype, which):
    """Float16 caches too: the kernel widens each element to float32 as the torch path does. A shape the
    AVX-512 kernel does not take (head_dim 32) goes to the AVX2 one."""
    q, k, v, tables, lens = random_case(7, heads, kv_heads, head_dim, block_size, seed=heads)
    lens[0] = (lens[0] + block_size - 1) // block_size * block_size  # a context filling its last block
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    ref_impl, kernel = pa.TorchDecodeAttention(), kernel_for(which)
    ref = ref_impl(ref_impl.prepare(tables, lens, block_size), q, k, v, 0.125)
    out = kernel(kernel.prepare(tables, lens, block_size), q, k, v, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


needs_avx512 = pytest.mark.skipif(LIB is None or LIB512 is None, reason="no AVX-512 kernel here")


def cache_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return kv_quant.quantize(x) if dtype == torch.int8 else x.to(dtype)


@needs_avx512
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8], ids=["f32", "f16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", range(1, 9))
def test_the_avx512_kernel_takes_every_group_and_head_dim(group, head_dim, kv_dtype):
    """1 to 8 query heads per KV head (the kernel's tiles of four heads full, partial, several), head_dim
    64 / 128 / 256, each cache dtype, against torch's gather + SDPA over the same cache: contexts filling
    their last block, one past it, ragged ones, and three rows of one prompt (one task holding every
    query head of the three rows). Each row's bits are the ones it gets alone."""
    kv_heads, bs = 2, 8
    q, k, v, tables, lens = random_case(6, group * kv_heads, kv_heads, head_dim, bs, seed=group * head_dim, max_len=70)
    lens[0], lens[1] = 2 * bs, 2 * bs + 1  # a context filling its last block, one crossing into the next
    lens[2] = max(int(lens[2]), 6)
    tables[3:5], lens[3:5] = tables[2], torch.tensor([lens[2] - 1, lens[2] - 5])  # the prompt's other tokens
    k, v = cache_as(k, kv_dtype), cache_as(v, kv_dtype)
    kernel = kernel_for("avx512")
    suffix = {torch.float32: "f32", torch.float16: "f16", torch.int8: "q8"}[kv_dtype]
    assert kernel.kernel_for(group * kv_heads, kv_heads, head_dim, kv_dtype) is getattr(
        LIB512, f"paged_decode_attention_avx512_{suffix}")
    assert_close_to_torch_and_rows_alone(kernel, tables, lens, bs, q, k, v)


@needs_avx512
def test_the_avx512_kernel_refuses_shapes_it_does_not_take():
    """Called directly with a shape outside its reach it returns -2 and writes nothing; the plan never
    sends one (avx512_refuses names why, and paged_attention.c takes them)."""
    for heads, kv_heads, head_dim in ((4, 2, 32), (4, 2, 96), (18, 2, 64), (9, 1, 128), (2, 1, 320), (3, 2, 64)):
        q, k, v, tables, lens = random_case(2, heads, kv_heads, head_dim, 8, seed=0)
        out = torch.zeros_like(q)
        status = LIB512.paged_decode_attention_avx512_f32(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), 2, heads,
            kv_heads, head_dim, 8, 0.125, out.data_ptr())
        assert status == -2 and not out.any(), (heads, kv_heads, head_dim)
    assert pa.avx512_refuses(18, 2, 64) == "9 query heads per KV head (it takes up to 8)"
    assert pa.avx512_refuses(4, 2, 96) == "head_dim 96 (it takes a multiple of 64 up to 256)"
    assert pa.avx512_refuses(2, 1, 320) == "head_dim 320 (it takes a multiple of 64 up to 256)"
    assert pa.avx512_refuses(16, 8, 128) is None and pa.avx512_refuses(14, 2, 64) is None  # Qwen3, Qwen2.5-0.5B
    kernel = kernel_for("avx512")
    assert kernel.kernel_for(18, 2, 64, torch.float16) is LIB.paged_decode_attention_f16  # the AVX2 kernel's


@needs_kernel
@pytest.mark.parametrize("which", KERNELS)
def test_long_contexts_take_the_heap_buffer(which):
    """Contexts past the kernel's stack buffer (256+ positions) allocate theirs: same results."""
    q, k, v, tables, lens = random_case(3, 9, 3, 64, 16, seed=7, max_len=1500)
    assert lens.max() > 430  # 8 bytes of offset and 4 x 4 of scores a position: past the 10 KB buffer
    ref_impl, kernel = pa.TorchDecodeAttention(), kernel_for(which)
    ref = ref_impl(ref_impl.prepare(tables, lens, 16), q, k, v, 0.125)
    out = kernel(kernel.prepare(tables, lens, 16), q, k, v, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("which", KERNELS)
def test_kernel_rows_do_not_depend_on_the_batch(which):
    q, k, v, tables, lens = random_case(9, 9, 3, 64, 16, seed=1)
    kernel = kernel_for(which)
    full = kernel(kernel.prepare(tables, lens, 16), q, k, v, 0.125)
    for s in range(9):
        one = kernel(kernel.prepare(tables[s : s + 1, :], lens[s : s + 1], 16), q[s : s + 1], k, v, 0.125)
        assert torch.equal(one, full[s : s + 1])


def rows_case(rows: list[tuple[torch.Tensor, int]], heads: int, head_dim: int, gen: torch.Generator):
    """(block tables [rows, 40] zero-padded, context lengths, random queries) for rows of (table, context)."""
    tables = torch.zeros(len(rows), 40, dtype=torch.long)
    for r, (table, _) in enumerate(rows):
        tables[r, : len(table)] = table
    return tables, torch.tensor([c for _, c in rows]), torch.randn(len(rows), heads, head_dim, generator=gen)


@needs_kernel
@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 128)])  # SmolLM2's, Qwen2.5-1.5B's
def test_a_prompts_rows_share_a_task_and_keep_their_bits(which, kv_dtype, heads, kv_heads, head_dim):
    """A prompt's tokens in one step are rows with one block table and their own contexts; both kernels
    run up to 8 of them in one task, reading each K/V row of the context once for all of them (a run
    longer than 8 split evenly: the 23 rows below are tasks of 7, 8 and 8). Each row still gets the
    bits it gets alone, next to decode rows, a second prompt whose table shares the first one's leading
    blocks (a prefix-cache hit), rows out of order, and contexts past the stack buffer."""
    gen = torch.Generator().manual_seed(5)
    bs = 16
    k = torch.randn(160 * bs, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(160 * bs, kv_heads, head_dim, generator=gen).to(kv_dtype)
    perm = torch.randperm(160, generator=gen)
    prompt, other, shared = perm[:40], perm[40:60], torch.cat([perm[:3], perm[60:70]])
    rows = [(prompt, c) for c in range(570, 590)]  # 20 tokens of a long prompt
    rows += [(shared, c) for c in (5, 48, 33, 150, 151)]  # within (joining that run), then past, its shared blocks
    rows += [(other, 37), (other, 301)]  # decodes
    rows += [(prompt, c) for c in (3, 1, 2)]  # a short prompt's tokens, out of order
    tables, lens, q = rows_case(rows, heads, head_dim, gen)
    kernel = kernel_for(which)
    assert_close_to_torch_and_rows_alone(kernel, tables, lens, bs, q, k, v)


@needs_kernel
@pytest.mark.parametrize("which", KERNELS)
def test_a_task_reads_through_its_longest_rows_table(which):
    """A run of rows whose tables agree over each row's own blocks (a prompt, rows sharing its first
    blocks, the prompt again further on) split into tasks: the second task starts on a sharing row but
    holds the prompt's longest row, whose context only the prompt's table maps."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    k = torch.randn(80 * bs, kv_heads, head_dim, generator=gen)
    v = torch.randn(80 * bs, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(80, generator=gen)
    prompt, shared = perm[:40], torch.cat([perm[:3], perm[40:50]])
    rows = [(prompt, 40)] + [(shared, 33)] * 8 + [(prompt, 570)]  # one run of 10: tasks of 5 and 5
    tables, lens, q = rows_case(rows, heads, head_dim, gen)
    kernel, ref_impl = kernel_for(which), pa.TorchDecodeAttention()
    out = kernel(kernel.prepare(tables, lens, bs), q, k, v, 0.125)
    torch.testing.assert_close(out, ref_impl(ref_impl.prepare(tables, lens, bs), q, k, v, 0.125), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_prompt_tokens_are_single_queries_through_the_kernel(tokenizer):
    """With the C kernel, every prompt token is a query with its own context length (the causal mask),
    while the projections still split decode-like rows from long chunks; logits match the span path."""
    from tokenloom import EngineConfig, SamplingParams
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model
    from tokenloom.runner import SHORT_CHUNK

    cfg = ModelConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512)
    batches, logits = [], []
    for kernel in (pa.TorchDecodeAttention(), kernel_for(None)):
        model = random_model(cfg, seed=3)
        model.decode_attention = kernel
        forward = model.forward

        def spy(ids, batch, kv, forward=forward):
            batches.append(batch)
            out = forward(ids, batch, kv)
            logits.append(out[1])
            return out

        model.forward = spy
        engine = LLMEngine(EngineConfig(max_num_batched_tokens=64, num_kv_blocks=64), model=model, tokenizer=tokenizer)
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.add_request("short", list(range(100, 100 + SHORT_CHUNK - 6)), greedy)
        engine.add_request("long", list(range(300, 340)), greedy)
        while engine.has_unfinished_requests():
            engine.step()
    spans, single = batches[: len(batches) // 2], batches[len(batches) // 2 :]
    first = single[0]
    assert first.prefills == [] and first.num_decodes == len(first.positions) == SHORT_CHUNK - 6 + 40
    assert first.decode_like_rows == SHORT_CHUNK - 6
    assert torch.equal(first.decode_context_lens, first.positions + 1)
    assert spans[0].num_decodes == 0 and len(spans[0].prefills) == 2
    for a, b in zip(logits[: len(logits) // 2], logits[len(logits) // 2 :], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_the_kernel_refuses_what_it_was_not_loaded_for():
    """A cache dtype without a kernel, or a context longer than its block table: a clear error before
    any C code reads memory it should not."""
    q, k, v, tables, lens = random_case(3, 9, 3, 64, 16, seed=2)
    kernel = kernel_for(None)
    with pytest.raises(ValueError, match="no kernel for"):
        kernel(kernel.prepare(tables, lens, 16), q, k.bfloat16(), v.bfloat16(), 0.125)
    too_long = lens.clone()
    too_long[1] = tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="longer than its block table"):
        kernel.prepare(tables, too_long, 16)


def masked_window_attention(q, k, v, tables, lens, block_size, window, scale):
    """The reference a sliding-window query is held to: its whole context gathered, every position
    before its last `window` masked out."""
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
    keys = torch.arange(slots.shape[1])[None, :]
    mask = (keys < lens[:, None]) & (keys >= lens[:, None] - window)
    kd, vd = k[slots].float().transpose(1, 2), v[slots].float().transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask[:, None, None, :],
                                                           scale=scale, enable_gqa=True)
    return out.squeeze(2)


@pytest.mark.parametrize("which", [pytest.param("torch", id="torch"), *KERNELS])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 256), (16, 2, 128)])
def test_a_sliding_window_reads_only_its_last_positions(which, kv_dtype, heads, kv_heads, head_dim):
    """Contexts longer and shorter than the window in one batch (Gemma 3's head_dim 256 and a GQA
    group; head_dim 128 and 8 query heads per KV head). Blocks wholly behind a row's window are
    overwritten with NaN first, as if released and reused: nothing reads them."""
    if which != "torch" and LIB is None:
        pytest.skip("the C kernel does not build or run here (logged)")
    block_size, window = 4, 11
    q, k, v, tables, lens = random_case(6, heads, kv_heads, head_dim, block_size, seed=3, max_len=60)
    lens[0] = 5  # within the window
    ref = masked_window_attention(q, k.to(kv_dtype), v.to(kv_dtype), tables, lens, block_size, window, 0.1)
    for row, n in enumerate(lens.tolist()):
        for b in range(max(n - window, 0) // block_size):
            k[tables[row, b] * block_size : (tables[row, b] + 1) * block_size] = float("nan")
            v[tables[row, b] * block_size : (tables[row, b] + 1) * block_size] = float("nan")
    impl = pa.TorchDecodeAttention() if which == "torch" else kernel_for(which)
    out = impl(impl.prepare(tables, lens, block_size, window), q, k.to(kv_dtype), v.to(kv_dtype), 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
