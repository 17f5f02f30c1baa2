"""The fast weight formats (model/quant/): int4 packing is exact against the dequantized Q4_1
weights, the kernels are row-invariant, and on the real model each fast path stays close to float32
(teacher-forced top-1 agreement and KL on natural text) and greedy decoding stays batch-invariant."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenloom.model import vocab_select
from tokenloom.model.gguf_blocks import LOW_BIT_BLOCKS, q4_1_blocks, q5_0_blocks
from tokenloom.model.gguf_tensors import StoredRows
from tokenloom.model.loader import dequantize, quantize_model
from tokenloom.model.quant import gemm
from tokenloom.model.quant.formats import resolve_quantization
from tokenloom.model.quant.gemm import LARGE_OUTPUT_BYTES, quant_gemm_avx2, quant_gemm_avx512
from tokenloom.model.quant.head import RescoredHead, int4_head
from tokenloom.model.quant.layouts import (
    dequantize_blocks,
    q4_1_from_dense,
    quantize_int8,
    quantize_int8_grouped,
)
from tokenloom.model.quant.modules import Int4Linear, Int8Linear
from tokenloom.model.quant.probe import detect, torch_quant_ops

CAP = detect() | torch_quant_ops()
needs_int4 = pytest.mark.skipif(not CAP["int4_bf16"], reason="int4 with bf16 activations does not run here")
needs_int8 = pytest.mark.skipif(not CAP["int8_bf16"], reason="int8 with bf16 activations does not run here")
# The int4 kernels that run here: torch's, and the project's C kernels (AVX-512 VNNI; AVX2 + FMA).
needs_c = pytest.mark.skipif(quant_gemm_avx512() is None, reason="no AVX-512 C kernel here")
needs_c_avx2 = pytest.mark.skipif(quant_gemm_avx2() is None, reason="no AVX2 C kernel here")
C_KERNELS = [pytest.param("c", id="c", marks=needs_c), pytest.param("c-avx2", id="c-avx2", marks=needs_c_avx2)]
INT4_KERNELS = [pytest.param(None, id="torch", marks=needs_int4), *C_KERNELS]


def int4_kernel(name):
    return {"c": quant_gemm_avx512, "c-avx2": quant_gemm_avx2}[name]() if name else None


def random_q4_1_bytes(n: int, k: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    nb = n * k // 32
    d = (rng.random(nb) * 0.05 + 1e-3).astype(np.float16)
    m = (-rng.random(nb) * 0.4).astype(np.float16)
    q = rng.integers(0, 16, size=(nb, 32), dtype=np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)  # GGML: low nibbles hold the first 16 weights
    raw = np.concatenate([d.view(np.uint8).reshape(nb, 2), m.view(np.uint8).reshape(nb, 2), packed], axis=1)
    return raw.reshape(-1)


def test_q4_1_blocks_dequantize_like_the_loader():
    data = random_q4_1_bytes(48, 96)
    blocks = q4_1_blocks(data, (48, 96))
    assert torch.equal(dequantize_blocks(blocks), dequantize(data, "Q4_1", (48, 96)))


def test_int4_pack_is_bit_exact_with_float32_scales():
    """torch's op computes (q - 8) * scale + zero; with zero = m + 8d that is the Q4_1 weight d*q + m."""
    n, k = 64, 128
    blocks = q4_1_blocks(random_q4_1_bytes(n, k, seed=1), (n, k))
    w = dequantize_blocks(blocks)
    layer = Int4Linear(blocks, torch.float32)
    assert torch.equal(layer(torch.eye(k)).t(), w)  # row i of eye @ W^T is column i of W^T
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", INT4_KERNELS)
def test_int4_bf16_close_and_row_invariant(kernel):
    n, k = 96, 192
    blocks = q4_1_blocks(random_q4_1_bytes(n, k, seed=2), (n, k))
    w = dequantize_blocks(blocks)
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    x = torch.randn(40, k).bfloat16()
    out = layer(x)
    ref = x.float() @ w.t()
    assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    rows = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    assert torch.equal(out, rows), "a row's result must not depend on the other rows"


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 15, 33])
def test_int4_c_kernel_matches_the_q4_1_weights(kernel, rows):
    """Only the activations are rounded (to int8 per group of 32, outliers kept): against the dequantized
    weights in float64 the error is float32 accumulation noise; every tile shape (however the rows fall
    into tiles, columns % 48) gives the same bits."""
    n, k = 112, 96  # 7 column blocks: a full tile of 3, another, and one of 1
    blocks = q4_1_blocks(random_q4_1_bytes(n, k, seed=5), (n, k))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    x = with_outliers(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)))
    out = layer(x)
    xr = int8_groups(x)
    ref = xr.double() @ dequantize_blocks(blocks).double().t()
    assert out.dtype == torch.float32
    # Sums of 96 products reach |10|; their float32 rounding reached 1.2e-5 for 1 draw in 300 (measured).
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=5e-5)
    assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(rows)]))


def q5_0_bytes(n: int, k: int, seed: int = 0, qtype: str = "Q5_0") -> np.ndarray:
    """Q5_0 (or `qtype`) blocks of a random [n, k] weight, written by gguf's own quantizer (the file
    format's reference)."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def test_q5_0_blocks_dequantize_like_the_loader():
    data = q5_0_bytes(48, 96)
    blocks = q5_0_blocks(data, (48, 96))
    assert blocks[..., 2:].max() > 15  # fifth bits in use
    assert torch.equal(dequantize_blocks(blocks), dequantize(data, "Q5_0", (48, 96)))


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_int5_c_kernel_matches_the_q5_0_weights(kernel, rows):
    """Q5_0 straight into the kernels (int4's nibbles plus the fifth bits): against the dequantized weights
    the error is the activations' rounding only, and a row's bits do not depend on the other rows."""
    n, k = 112, 96
    blocks = q5_0_blocks(q5_0_bytes(n, k, seed=6), (n, k))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    assert layer.bits == 5
    x = with_outliers(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)))
    out = layer(x)
    xr = int8_groups(x)
    ref = xr.double() @ dequantize_blocks(blocks).double().t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0"])
def test_symmetric_codes_keep_no_offsets_and_give_the_same_bits(kernel, qtype):
    """Q4_0's and Q5_0's offset is -8d / -16d: the layer keeps none, and the kernel computing it gives the
    bits it gives reading it."""
    n, k = 112, 96
    blocks = LOW_BIT_BLOCKS[qtype](q5_0_bytes(n, k, seed=8, qtype=qtype), (n, k))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    assert layer.offsets is None and layer.bits == (5 if qtype == "Q5_0" else 4)
    x = torch.randn(9, k)
    stored = layer.scales * -(2 ** (layer.bits - 1))  # the same offsets, read from memory
    assert torch.equal(layer(x), layer.kernel.int4(x, layer.codes, layer.scales, stored, layer.fifth))
    ref = x.double() @ dequantize_blocks(blocks).double().t()
    torch.testing.assert_close(layer(x).double(), ref, rtol=2e-2, atol=2e-2)


def test_five_bit_blocks_are_refused_by_torchs_int4_op():
    """torch's int4 op cannot take 5-bit codes: refused by name, never truncated to 4 bits (quantize_model
    gives such a projection the grouped int8 layer where the C kernels do not run)."""
    blocks = q5_0_blocks(q5_0_bytes(32, 64, seed=7), (32, 64))
    with pytest.raises(ValueError, match="5-bit codes need the C kernels"):
        Int4Linear(blocks, torch.bfloat16, kernel=None)


def int8_groups(x: torch.Tensor, outlier_ratio: float = 6.0) -> torch.Tensor:
    """x as the C int4 / int5 kernels round it, in float32 arithmetic as theirs: per row and group of 32,
    an input over `outlier_ratio` times the group's mean magnitude (an outlier) as it is, the rest int8
    times their largest magnitude / 127 (llama.cpp's Q8_0), round half to even."""
    g = x.float().reshape(x.shape[0], -1, 32)
    outlier = g.abs() > outlier_ratio * g.abs().sum(-1, keepdim=True) / 32
    rest = torch.where(outlier, 0.0, g)
    largest = rest.abs().amax(-1, keepdim=True)
    rounded = ((rest * (127 / largest)).round().double() * (largest / 127).double()).nan_to_num(0.0)
    return torch.where(outlier, g.double(), rounded).reshape(x.shape)


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """x with an input far above the rest in most groups (RMS-normed activations' outlier channels)."""
    x = x.clone()
    x[:, 3::40] *= 30
    return x


def int16_groups(x: torch.Tensor) -> torch.Tensor:
    """x as the AVX2 int4 kernel rounds it: per row and group of 32, int16 times a power of two,
    2^(e - 15) for the group's largest magnitude f * 2^e (f in [0.5, 1)), round half to even."""
    g = x.double().reshape(x.shape[0], -1, 32)
    _, e = torch.frexp(g.abs().amax(-1, keepdim=True))
    scale = torch.ldexp(torch.ones_like(g[..., :1]), e - 15)
    return ((g / scale).round().clamp(-32768, 32767) * scale).reshape(x.shape)


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0"])
def test_int8_groups_keep_their_outliers_in_float32(kernel, qtype):
    """An input far above its group's others meets its weights in float32; rounded with them to int8 it
    would leave them a few bits (the error here ~30x larger). Shared, own and no outliers: 6 rows are one
    tile walking its rows' lists on AVX-512 (AVX2's tiles are 4: indexed), 18 rows are indexed input by
    input on both; either way each row as it comes alone."""
    n, k = 48, 64
    data = random_q4_1_bytes(n, k, seed=4) if qtype == "Q4_1" else q5_0_bytes(n, k, seed=4)
    blocks = LOW_BIT_BLOCKS[qtype](data, (n, k))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(0))
    x[:5, 9] = torch.tensor([80.0, -55.0, 120.0, 60.0, -70.0])
    x[1, 40], x[2, 3], x[4, 63] = 90.0, -75.0, 65.0
    w = dequantize_blocks(blocks).double()
    out = layer(x).double()
    torch.testing.assert_close(out, int8_groups(x) @ w.t(), rtol=1e-5, atol=1e-4)
    for r in range(len(x)):
        assert torch.equal(out[r], layer(x[r:r + 1])[0].double()), r
    assert torch.equal(layer(torch.cat([x, x.flip(0), x])).double(), torch.cat([out, out.flip(0), out]))
    all_rounded = int8_groups(x, outlier_ratio=float("inf"))
    exact = x.double() @ w.t()
    assert (all_rounded @ w.t() - exact).abs().mean() > 10 * (out - exact).abs().mean()


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_int4_kernel_keeps_non_finite_activations(kernel):
    """A NaN or an infinity reaches its own row's outputs, as through float32 matmuls; rows without one
    are untouched; an all-zero row gives zeros."""
    blocks = q4_1_blocks(random_q4_1_bytes(32, 64, seed=9), (32, 64))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    x = torch.randn(4, 64)
    x[1, 5], x[2, 40], x[3] = float("nan"), float("inf"), 0.0
    out = layer(x)
    assert out[1].isnan().all() and not out[2].isfinite().any()
    assert torch.equal(out[0], layer(x[:1])[0]) and torch.equal(out[3], torch.zeros(32))


@needs_c
@needs_c_avx2
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q5_0"])
@pytest.mark.parametrize("rows", [5, 13])
def test_avx512_and_avx2_int4_kernels_give_the_same_bits(qtype, rows):
    """The two C kernels round the activations alike (csrc/quant_rows.h), sum the integer products exactly
    and do the same float operations in the same order: an AVX-512 machine's outputs are an AVX2 one's.
    5 rows: AVX-512's one tile walks its rows' outliers, AVX2 (tiles of 4) adds them input by input."""
    n, k = 112, 160
    data = random_q4_1_bytes(n, k, seed=11) if qtype == "Q4_1" else q5_0_bytes(n, k, seed=11, qtype=qtype)
    blocks = LOW_BIT_BLOCKS[qtype](data, (n, k))
    x = with_outliers(torch.randn(rows, k, generator=torch.Generator().manual_seed(3)))
    outs = [Int4Linear(blocks, torch.bfloat16, kernel=kernel)(x) for kernel in (int4_kernel("c"), int4_kernel("c-avx2"))]
    assert torch.equal(*outs)


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_c_gemm_refuses_activations_of_the_wrong_shape_or_dtype(kernel):
    blocks = q4_1_blocks(random_q4_1_bytes(32, 64, seed=8), (32, 64))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    for x in (torch.randn(2, 96), torch.randn(2, 64).double()):
        with pytest.raises(ValueError, match="quantized gemm"):
            layer.kernel.int4(x, layer.codes, layer.scales, layer.offsets)


@pytest.mark.parametrize("kernel", INT4_KERNELS)
def test_int4_decode_rows_and_prefill_rows_take_their_own_kernels(kernel):
    """Decode-like rows (the first `decode_like_rows`) go through int4 and give the same bits as alone;
    long prefill chunks go through the dense bfloat16 weights, with the same bits whatever comes first."""
    n, k = 96, 192
    blocks = q4_1_blocks(random_q4_1_bytes(n, k, seed=3), (n, k))
    int4_only = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    both = Int4Linear(blocks, torch.bfloat16, dense_prefill=True, kernel=int4_kernel(kernel))
    x = torch.randn(30, k)  # float32 residual stream: cast around the kernels
    mixed = both(x, 7)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed[:7], int4_only(x[:7]))
    assert torch.equal(mixed[7:], both(x[7:], 0))
    assert torch.equal(mixed[7:], F.linear(x[7:].bfloat16(), dequantize_blocks(blocks).bfloat16()).float())
    assert not torch.equal(both(x, 0)[:7], mixed[:7]), "the two kernels differ; the split must be by row kind"


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_grouped_int8_decode_rows_and_prefill_rows_take_their_own_kernels(kernel):
    """As int4's: the first rows through the grouped int8 kernel with their own bits, long chunks through
    the weight in bfloat16."""
    w = torch.randn(96, 192) * 0.1
    both = Int8Linear(w, torch.bfloat16, kernel=int4_kernel(kernel), grouped=True, dense_prefill=True)
    int8_only = Int8Linear(w, torch.bfloat16, kernel=int4_kernel(kernel), grouped=True)
    x = torch.randn(30, 192)
    mixed = both(x, 7)
    assert torch.equal(mixed[:7], int8_only(x[:7]))
    assert torch.equal(mixed[7:], F.linear(x[7:].bfloat16(), w.bfloat16()).float())


# The int4 scan runs on the C kernels only (without them quantize_model keeps the int8 one).
@pytest.mark.parametrize("kernel, scan", [
    pytest.param(None, "int8", id="torch-int8", marks=needs_int8),
    *(pytest.param(k.values[0], scan, id=f"{k.id}-{scan}", marks=k.marks) for k in C_KERNELS for scan in ("int8", "int4")),
])
def test_rescored_head_has_the_float32_argmax_and_is_row_invariant(kernel, scan):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5008, 64, generator=gen)
    x = torch.randn(40, 64, generator=gen)
    k = int4_kernel(kernel)
    # int4: built 1024 rows at a time and stacked, as a 150k-row vocabulary is (5008 = 4 x 1024 + 912)
    approx = int4_head(w, k, rows=1024) if scan == "int4" else Int8Linear(w, torch.bfloat16, k)
    head = RescoredHead(approx, w)
    assert head.format == scan
    out, ref = head(x), x @ w.t()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    top = ref.topk(4, dim=-1).indices
    torch.testing.assert_close(out.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    noise = {"int8": 0.05, "int4": 0.25}[scan]  # the rest: the scan's rounding
    assert (out - ref).abs().max() <= noise * ref.abs().max()
    assert torch.equal(out, torch.cat([head(x[i : i + 1]) for i in range(40)]))
    if scan == "int4":  # the stacked chunks are the whole head's
        whole = Int4Linear(q4_1_from_dense(w), torch.bfloat16, kernel=k)
        assert torch.equal(approx(x), whole(x))


def test_q4_1_from_dense_round_trip():
    w = torch.randn(32, 64) * 0.1
    err = (dequantize_blocks(q4_1_from_dense(w)) - w).abs()
    step = (w.view(32, 2, 32).amax(-1) - w.view(32, 2, 32).amin(-1)) / 15
    assert (err.view(32, 2, 32) <= step[..., None] * 0.51 + 1e-3).all()


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("codes", ["q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int4_top_keeps_each_rows_largest_outputs(kernel, codes, rows):
    """int4_top: each row's `keep` largest outputs of int4_gemm, the same bits, with their columns, the
    whole output never stored; a row that meets a NaN says so."""
    k = int4_kernel(kernel)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(4992, 64, generator=gen)
    blocks = q4_1_from_dense(w)
    if codes == "q4_0":  # symmetric codes: no offsets kept, the kernels compute them
        blocks[..., 1] = -8 * blocks[..., 0]
    layer = Int4Linear(blocks, torch.bfloat16, kernel=k)
    assert (layer.offsets is None) == (codes == "q4_0")
    x = with_outliers(torch.randn(rows, 64, generator=gen))  # more rows than a tile: the outlier index
    full = layer(x)
    values, ids, unordered = k.int4_top(x, layer.codes, layer.scales, layer.offsets, 18)
    best, order = values.topk(18, dim=1)
    assert torch.equal(best, full.topk(18, dim=1).values)
    assert torch.equal(full.gather(1, ids.gather(1, order)), best)
    assert not unordered.any()
    x[-1, 5] = float("nan")
    assert k.int4_top(x, layer.codes, layer.scales, layer.offsets, 18)[2].tolist() == [False] * (rows - 1) + [True]


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("top", [1, 2, 16])
def test_rescored_head_argmax_is_forwards_without_its_logits(kernel, top):
    """RescoredHead.argmax gives forward's argmax on every row: where a candidate's exact logit wins, where
    a scan value outside the candidates does (frequent with top 1), and where the scan ties at the
    candidates' edge (a row repeated 100 times in the vocabulary: forward's own path)."""
    gen = torch.Generator().manual_seed(top)
    w = torch.randn(5008, 64, generator=gen)
    w[4000:4100] = w[17]
    x = torch.randn(300, 64, generator=gen)
    x[:20] = w[17] * 3 + torch.randn(20, 64, generator=gen) * 0.1  # row 17 and its copies on top
    head = RescoredHead(int4_head(w, int4_kernel(kernel), rows=1024), w, top=top)
    want = vocab_select.argmax(head(x))
    assert torch.equal(head.argmax(x), want)
    assert torch.equal(torch.cat([head.argmax(x[i : i + 1]) for i in range(0, 300, 37)]), want[::37])
    if top == 1:  # the scan's noise puts a non-candidate above the candidate's exact logit somewhere
        scan = head.approx(x)
        assert (scan.topk(2, dim=1).indices[:, 1] == want).any()
    # A NaN row (its scan all NaN, no id kept) takes forward's path, the other rows theirs; bfloat16 rows
    # (forward rounds their scan) take forward's path too.
    x[5, 7] = float("nan")
    assert torch.equal(head.argmax(x), vocab_select.argmax(head(x)))
    stored = RescoredHead(head.approx, StoredRows(w.numpy(), "F32", tuple(w.shape)), top=top)
    assert torch.equal(stored.argmax(x), vocab_select.argmax(stored(x)))  # a file-backed head: ids never -1
    xb = x[6:40].bfloat16()
    assert torch.equal(head.argmax(xb), vocab_select.argmax(head(xb)))


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int8_c_kernel_is_exact_on_its_activations(kernel, rows):
    """int8 codes times the activations (rounded to bfloat16 by the AVX512-BF16 kernel, to int16 per
    group of 32 by the AVX2 one), each column's scale after the sum: float32 accumulation noise
    against float64."""
    w = torch.randn(112, 96) * 0.1
    layer = Int8Linear(w, torch.bfloat16, kernel=int4_kernel(kernel))
    q, scale = quantize_int8(w)
    x = torch.randn(rows, 96)
    out = layer(x)
    ref = ((x.bfloat16() if kernel == "c" else int16_groups(x)).double() @ q.double().t()) * scale.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_grouped_int8_c_kernel_is_exact_on_its_activations(kernel, rows):
    """A scale per group of 32 inputs and column (the projections a GGUF stores wider than 4 bits): each
    group's integer-weight sums times its scale, float32 accumulation noise against float64; a weight
    with one large group keeps the small groups' precision (a per-column scale would not)."""
    w = torch.randn(112, 96) * 0.1
    w[:, :32] *= 50  # the first group of every column is 50x the others
    layer = Int8Linear(w, torch.bfloat16, kernel=int4_kernel(kernel), grouped=True)
    q, scale = quantize_int8_grouped(w)
    x = with_outliers(torch.randn(rows, 96))  # the AVX-512 kernel's int8 groups keep them in float32
    xr = (int8_groups(x) if kernel == "c" else int16_groups(x)).double()
    ref = (xr.reshape(rows, 1, 3, 32) * (q.double().reshape(1, 112, 3, 32) * scale.double()[None, :, :, None])).sum((2, 3))
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(rows)]))
    dequantized = (q.float().reshape(112, 3, 32) * scale[..., None]).reshape(112, 96)
    assert ((dequantized - w)[:, 32:].abs().max()) <= w[:, 32:].abs().max() / 254 + 1e-6


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_grouped_int8_kernel_keeps_non_finite_activations(kernel):
    """As int4's: a NaN or an infinity reaches its own row's outputs, the other rows untouched."""
    layer = Int8Linear(torch.randn(48, 64) * 0.1, torch.bfloat16, kernel=int4_kernel(kernel), grouped=True)
    x = torch.randn(4, 64)
    x[1, 5], x[2, 40], x[3] = float("nan"), float("inf"), 0.0
    out = layer(x)
    assert out[1].isnan().all() and not out[2].isfinite().any()
    assert torch.equal(out[0], layer(x[:1])[0]) and torch.equal(out[3], torch.zeros(48))


@needs_int8
def test_int8_close_and_row_invariant():
    w = torch.randn(80, 64) * 0.1
    layer = Int8Linear(w, torch.bfloat16)
    x = torch.randn(20, 64).bfloat16()
    out = layer(x)
    ref = x.float() @ w.t()
    assert (out.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(20)]))


def test_quantization_names():
    assert resolve_quantization(None) == "none"
    assert resolve_quantization("q4") == "int4"
    assert resolve_quantization("INT8") == "int8"
    with pytest.raises(ValueError):
        resolve_quantization("int3")


@needs_int4
def test_random_model_int4_runs_in_bfloat16():
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model

    TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)

    model = quantize_model(random_model(TINY, dtype="bfloat16"), "int4")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)


@pytest.mark.parametrize("method", [
    pytest.param("int4", marks=pytest.mark.skipif(not CAP.get("int4_c"), reason="no C int4 kernel here")), "none"])
def test_long_chunks_pass_through_the_mlp_in_slices_with_the_same_bits(method):
    """On the C kernels a chunk longer than MLP_ROWS_PER_PASS goes through the MLP a slice of rows at a
    time (its activations are a step's biggest buffers), every row keeping the bits of one pass; dense
    float32 projections (whose rows' bits depend on the matmul's shape) take the chunk in one pass."""
    from tokenloom.model import decoder
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=1, num_heads=4, num_kv_heads=2)
    model = random_model(cfg)
    if method != "none":
        model = quantize_model(model, method)
    mlp = model.layers[0].mlp
    x = torch.randn(2 * decoder.MLP_ROWS_PER_PASS + 37, 64, generator=torch.Generator().manual_seed(5))
    batch = mock.Mock(lora=None, decode_like_rows=x.shape[0])
    calls = []
    with mock.patch.object(mlp, "_rows", side_effect=lambda rows, *a, **kw: calls.append(len(rows))
                           or type(mlp)._rows(mlp, rows, *a, **kw)):
        sliced = mlp(x, batch)
    assert calls == ([decoder.MLP_ROWS_PER_PASS] * 2 + [37] if method != "none" else [x.shape[0]])
    with mock.patch.object(decoder, "MLP_ROWS_PER_PASS", x.shape[0]):
        whole = mlp(x, batch)
    assert torch.equal(sliced, whole)


@pytest.mark.skipif(not CAP.get("int4_c"), reason="no C int4 kernel here")
def test_every_layers_mlp_writes_its_activations_into_the_models_one_pair_of_pass_buffers():
    """The C kernels write each MLP pass's [rows, 2 x intermediate] and [rows, intermediate] activations
    into buffers the model's layers share (no new output buffer for them), with the bits of new ones."""
    from tokenloom.model import decoder
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.loader import random_model

    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)
    model = quantize_model(random_model(cfg), "int4")
    first, second = (layer.mlp for layer in model.layers)
    assert first.pass_buffers is second.pass_buffers
    x = torch.randn(decoder.MLP_ROWS_PER_PASS + 50, 64, generator=torch.Generator().manual_seed(9))
    batch = mock.Mock(lora=None, decode_like_rows=x.shape[0])
    made = []
    with mock.patch.object(gemm, "_output_buffer", side_effect=lambda rows, n: made.append(n) or torch.empty(rows, n)):
        outs = [mlp(x, batch) for mlp in (first, second)]
    assert made == []  # the gate_up and down projections alike: down writes into the output rows
    gate_up, act = first.pass_buffers.take(x[: decoder.MLP_ROWS_PER_PASS])
    assert gate_up.shape == (decoder.MLP_ROWS_PER_PASS, 320) and act.shape == (decoder.MLP_ROWS_PER_PASS, 160)
    assert not gate_up.is_inference()  # written in and out of inference mode alike
    for other in (x.bfloat16()[:4], x):  # other dtypes and more rows than a pass: the projections' own
        assert first.pass_buffers.take(other) == (None, None)
    with mock.patch.object(decoder.PassBuffers, "take", return_value=(None, None)):
        assert all(torch.equal(out, mlp(x, batch)) for out, mlp in zip(outs, (first, second)))


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_large_gemm_outputs_come_from_whole_row_steps_and_keep_their_bits(kernel):
    """An output of LARGE_OUTPUT_BYTES or more is a view of a buffer rounded up to OUTPUT_ROWS_STEP rows
    (so glibc reuses the blocks freed by batches of other sizes), contiguous and with each row's bits."""
    n, k = 8192, 64
    blocks = q4_1_blocks(random_q4_1_bytes(n, k, seed=6), (n, k))
    layer = Int4Linear(blocks, torch.bfloat16, kernel=int4_kernel(kernel))
    x = torch.randn(33, k)
    assert 33 * n * 4 >= LARGE_OUTPUT_BYTES
    out = layer(x)
    assert out.shape == (33, n) and out.is_contiguous()
    assert out.untyped_storage().nbytes() == 48 * n * 4
    assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(33)]))
    assert layer(x[:1]).untyped_storage().nbytes() == n * 4  # a small output is its own size


# --- the real model ---------------------------------------------------------------------------------

PROSE = """
The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his
father had taught him. There were one hundred and twelve of them, worn smooth in the middle by a
century of boots. At the top he trimmed the wick, polished the great lens with a soft cloth, and
waited for the first ships to appear on the horizon. On clear nights he could see the lights of the
harbour town across the bay, and sometimes he imagined the people there sitting down to supper,
unaware of the small tower that watched over their fishing boats.

Winters were hard on the island. Storms arrived from the north without warning, and the supply boat
could not land for weeks at a time. He kept a careful record of the flour, the lamp oil and the
firewood, and he rationed them so that nothing ran out before spring. In the long evenings he read
the books that visitors had left behind: novels with missing pages, a history of the Roman empire,
an old manual on the care of clocks. He learned to repair the clock in the kitchen, and afterwards it
kept better time than any clock in the town.

Scientists have long studied how birds find their way across thousands of kilometres of open ocean.
Some species appear to use the position of the sun during the day and the pattern of the stars at
night. Others seem to sense the Earth's magnetic field, perhaps through special proteins in their
eyes. Young birds often make their first migration alone, which suggests that much of this ability is
inherited rather than learned. Even so, experiments show that experience matters: older birds correct
for being blown off course, while younger ones simply continue in the original direction.

The small bakery on the corner opens at six in the morning. By then the baker has been at work for
three hours, shaping loaves, folding butter into pastry and checking the temperature of the ovens.
Regular customers arrive in a predictable order: the postman first, then the nurses coming off the
night shift, then parents with children on their way to school. Each of them has a usual order, and
the baker often has it wrapped before they reach the counter. On Saturdays there is a queue out of the
door, and the bread is usually sold out before noon.
"""


def natural_text() -> str:
    """Natural English that does not live in this repository's docs: the prose above, then the Python
    documentation's topics (shipped with every CPython)."""
    from pydoc_data import topics

    return PROSE + "\n" + "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:12000]


@pytest.fixture(scope="module")
def real_models():
    from tokenloom.model.load import model_path
    from tokenloom.model.loader import ModelSource, load_model

    source = ModelSource.resolve(model_path(None))
    return {name: load_model(source, **kw) for name, kw in [
        ("fp32", {}), ("bf16", {"dtype": "bfloat16"}), ("int4_bf16", {"quantization": "int4", "dtype": "bfloat16"}),
        ("int4", {"quantization": "int4"}), ("int8", {"quantization": "int8"}),
        ("int4_kv8", {"quantization": "int4", "kv_cache_dtype": "int8"}),  # over an int8 KV cache
    ]} | {"int4_avx2": avx2_kernel(lambda: load_model(source, quantization="int4"))}


def avx2_kernel(load):
    """The int4 model as an AVX2-only machine runs it: loaded with the AVX2 C kernels (their own int4
    layout) for every row and the head, no dense bfloat16 copy for long chunks. None where they do not
    run here."""
    if quant_gemm_avx2() is None:
        return None
    with mock.patch.dict(os.environ, {"TOKENLOOM_MAX_ISA": "avx2"}):  # the plan's CPU: no AVX-512
        model = load()
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    if any(m.kernel is not quant_gemm_avx2() for m in layers):
        return None
    for m in layers:
        if isinstance(m, Int4Linear):
            m.dense = None
    return model


def teacher_forced_logprobs(model, ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """log-softmax at every position of one prefill over the whole text, [N, vocab] float32."""
    hidden = teacher_forced_hidden(model, ids)
    return torch.cat([F.log_softmax(model.compute_logits(hidden[i : i + chunk]), -1) for i in range(0, len(ids), chunk)])


def teacher_forced_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The final hidden state at every position of one prefill over the whole text, [N, hidden]."""
    from tokenloom.model import kv_quant
    from tokenloom.model.decoder import ForwardBatch, PrefillSpan

    n, cfg = ids.numel(), model.config
    dtype = model.kv_cache_dtype or model.embed_tokens.weight.dtype  # the fast path's float16 cache included
    kv = torch.zeros(cfg.num_layers, 2, n, cfg.num_kv_heads, kv_quant.row_elements(dtype, cfg.dim_per_head),
                     dtype=dtype)  # an int8 cache's rows hold their scales
    kv = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    idx = torch.arange(n)
    batch = ForwardBatch(idx, idx, 0, 0, torch.empty((0, 0), dtype=torch.long), torch.empty(0, dtype=torch.long),
                         16, [PrefillSpan(0, n, idx, None)],
                         torch.empty(0, dtype=torch.long))
    with torch.inference_mode():
        return model(ids, batch, kv)[0]

_ALL_BF16 = pytest.mark.xfail(reason="all-bf16 residual stream: bf16 dense top-1 ~96.9%; int4_bf16 with the rescored "
                              "head ~98.5%, too near the bar to rely on (KL ~0.0015)", strict=False)


_INT8 = pytest.mark.xfail(reason="per-channel int8 re-quantized from Q4_1 weights: top-1 ~95.7%, KL ~0.004", strict=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["int4", "int4_avx2", pytest.param("int8", marks=_INT8), pytest.param("bf16", marks=_ALL_BF16), pytest.param("int4_bf16", marks=_ALL_BF16)])
def test_fast_path_quality_vs_float32(real_models, tokenizer, path):
    """int4/int8 keep the residual stream and KV cache in float32; "int4" is what serving runs, prompt
    and decode rows alike, with the rescored int8 LM head. The all-bfloat16 paths (bf16 dense,
    int4_bf16) have a tiny KL (~0.0013) but flip ~3% of near-tie argmaxes on this text: measured,
    expected to miss the 98% bar, kept as xfail so a change in either direction shows."""
    if path != "bf16" and not CAP[f"{path.split('_')[0]}_bf16"] or real_models[path] is None:
        pytest.skip(f"{path} does not run here")
    ids = torch.tensor(tokenizer.encode(natural_text()))
    assert ids.numel() >= 2000, ids.numel()
    ref = teacher_forced_logprobs(real_models["fp32"], ids)
    fast = teacher_forced_logprobs(real_models[path], ids)
    top1 = (ref.argmax(-1) == fast.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - fast)).sum(-1).mean().item()
    print(f"{path}: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats over {ids.numel()} positions")
    assert top1 >= 0.98 and kl <= 0.02, (top1, kl)


def run_requests(engine, prompts, params) -> list[list[int]]:
    """Each prompt (text or {"prompt_token_ids": ...}) a request under `params`, run to the end: their tokens."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    return [done[i] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["int4", "int4_avx2", "int4_kv8"])
def test_fast_path_greedy_is_batch_invariant(real_models, tokenizer, path):
    from tokenloom import EngineConfig, SamplingParams
    from tokenloom.engine.llm_engine import LLMEngine

    if not CAP["int4_bf16"] or real_models[path] is None:
        pytest.skip(f"{path} does not run here")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_num_batched_tokens=256, num_kv_blocks=512),
                       model=real_models[path], tokenizer=tokenizer)
    paragraphs = [p.strip() for p in PROSE.split("\n\n") if p.strip()]
    prompts = [p[: 60 + 90 * i] for i, p in enumerate(paragraphs)] + ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(batch_prompts, params=sp):
        return run_requests(engine, batch_prompts, params)

    engine.kv.reset_prefix_cache()
    alone = [run([p])[0] for p in prompts]
    engine.kv.reset_prefix_cache()
    assert run(prompts) == alone
    engine.kv.reset_prefix_cache()
    # Asking for logprobs takes the head's whole logits and the sampler (runner.argmax_only): the same tokens.
    assert run(prompts, sp.clone(logprobs=1)) == alone
    engine.kv.reset_prefix_cache()


def test_serve_defaults_to_the_fast_path_and_the_library_to_exact_float32():
    from tokenloom import EngineConfig
    from tokenloom.cli import build_parser

    assert build_parser().parse_args(["serve"]).quantization == "auto"
    assert build_parser().parse_args(["serve", "--quantization", "none"]).quantization == "none"
    assert EngineConfig().quantization is None
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3").validate()
