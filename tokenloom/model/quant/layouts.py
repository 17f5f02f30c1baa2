"""Quantization math and the kernels' weight layouts: blocks (model/gguf_blocks.py's [N, K/32, 34] of
scale, offset and codes) from a dense weight and back, per-channel and grouped int8, and each kernel's
packing: torch's int4 op's, csrc/quant_gemm.c's (`pack_c_layout`), csrc/quant_gemm_avx2.c's
(`pack_avx2_layout`), the int8 kernels' (`pack_int8_c_layout`, `pack_int8_quads`). The kernels' checks
(csrc/checks/quant_gemm.c) lay out their codes as these functions do."""

from __future__ import annotations

import torch

from ..gguf_tensors import StoredRows
from .formats import GROUP


def q4_1_from_dense(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric min/max 4-bit quantization of a dense [N, K] weight into the same block layout
    (for models that do not come as Q4_1: Hugging Face directories, random test models)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    codes = torch.where(d > 0, ((g - m) / d.clamp_min(1e-30)).round(), torch.zeros_like(g)).clamp(0, 15)
    return torch.cat([d, m, codes], dim=-1)


def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
    n, kb, _ = blocks.shape
    return (blocks[..., 2:] * blocks[..., 0:1] + blocks[..., 1:2]).reshape(n, kb * GROUP)


def pack_int4(blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [N, K/32, 34] -> (packed weight for `_weight_int4pack_mm_for_cpu`, scales_and_zeros
    [K/32, N, 2] in `dtype`)."""
    n, kb, _ = blocks.shape
    codes = blocks[..., 2:].reshape(n, kb * GROUP).to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    d, m = blocks[..., 0], blocks[..., 1]
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scales_zeros


def _per_block(v: torch.Tensor) -> torch.Tensor:
    """Q4_1's d or m [N, K/32] -> [N/16, K/32, 16] float16: each column block's 16 values per group."""
    n, kb = v.shape
    return v.to(torch.float16).reshape(n // 16, 16, kb).transpose(1, 2).contiguous()


def _scales_and_offsets(blocks: torch.Tensor, five_bit: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks' d and m per column block (`_per_block`); m None where every m is -8d (-16d for 5-bit codes):
    the symmetric formats' (Q4_0, Q5_0), which the kernels compute instead of reading (one float16 a
    group of 32 fewer to keep)."""
    d, m = _per_block(blocks[..., 0]), _per_block(blocks[..., 1])
    symmetric = torch.equal(m.float(), d.float() * -(16 if five_bit else 8))
    return d, None if symmetric else m


def pack_c_layout(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Blocks [N, K/32, 34] -> csrc/quant_gemm.c's layout: codes [N/16, K/32, 4, 64] uint8, byte 4c + p of
    quarter jq holding the code of column c, input 8jq + p of the group in its low nibble and input
    8jq + 4 + p in its high (a mask, or a shift and a mask, gives `vpdpbusd` four inputs of 16 columns);
    the fifth bits (None for 4-bit codes) [N/16, K/32, 4, 2] int64, bit 4c + p of word (jq, h) that of the
    code of column c, input 8jq + 4h + p; scales and offsets [N/16, K/32, 16] float16 (Q4_1's own)."""
    import numpy as np

    n, kb, _ = blocks.shape
    q = blocks[..., 2:].to(torch.uint8).reshape(n // 16, 16, kb, GROUP // 8, 2, 4)  # nb, c, g, jq, h, p
    q = q.permute(0, 2, 3, 1, 5, 4)  # nb, g, jq, c, p, h
    codes = ((q[..., 0] & 0xF) | ((q[..., 1] & 0xF) << 4)).reshape(n // 16, kb, GROUP // 8, 64)
    high = q >> 4
    fifth = None
    if high.any():  # 64 bits, first one lowest: the little-endian int64 words the kernel reads
        bits = high.permute(0, 1, 2, 5, 3, 4).reshape(n // 16, kb, GROUP // 8, 2, 64)  # nb, g, jq, h, 4c + p
        fifth = torch.from_numpy(np.packbits(bits.numpy(), axis=-1, bitorder="little")).view(torch.int64)[..., 0]
    return codes.contiguous(), fifth, *_scales_and_offsets(blocks, fifth is not None)


def pack_avx2_layout(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Blocks [N, K/32, 34] -> csrc/quant_gemm_avx2.c's layout: codes [N/16, K/32, 8, 32] uint8, byte 4c + p
    of slot jj holding the code of column c, input 4jj + p of the group in its low nibble and column
    8 + c's in its high (a mask, or a shift and a mask, gives vpmaddubsw's operand for 8 columns); the
    fifth bits (None for 4-bit codes) [N/16, K/32, 2, 32] uint8, bit b of byte i of plane h the fifth bit
    of byte i of code vector 8h + b (vector 2jj the low nibbles of slot jj, 2jj + 1 the high); scales and
    offsets as pack_c_layout's."""
    n, kb, _ = blocks.shape
    q = blocks[..., 2:].to(torch.int32).reshape(n // 16, 2, 8, kb, GROUP // 4, 4)  # nb, half, c, g, jj, p
    q = q.permute(0, 3, 4, 2, 5, 1)  # nb, g, jj, c, p, half
    codes = ((q[..., 0] & 0xF) | ((q[..., 1] & 0xF) << 4)).reshape(n // 16, kb, GROUP // 4, 32).to(torch.uint8)
    bits = (q >> 4) & 1
    fifth = None
    if bits.any():
        bits = bits.reshape(n // 16, kb, 2, 4, 8, 4, 2).permute(0, 1, 2, 4, 5, 3, 6)  # nb, g, h, c, p, jj % 4, half
        fifth = (bits.reshape(n // 16, kb, 2, 32, 8) << torch.arange(8)).sum(-1).to(torch.uint8).contiguous()
    return codes.contiguous(), fifth, *_scales_and_offsets(blocks, fifth is not None)


def pack_int8_c_layout(q: torch.Tensor, inputs: int = 2) -> torch.Tensor:
    """int8 [N, K] -> the C kernels' layout [N/16, K/inputs, 16, inputs]: each run of `inputs` adjacent
    inputs of 16 columns together (2: the int8 kernels' pairs; 4: the AVX-512 int8g's VNNI quads)."""
    n, k = q.shape
    return q.reshape(n // 16, 16, k // inputs, inputs).transpose(1, 2).contiguous()


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    return pack_int8_c_layout(q, 4)



def quantize_int8_grouped(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with a scale per group of 32 inputs: (int8 [N, K], float32 scales [N, K/32]). From a
    Q5_0 or Q8_0 weight (already such groups, 32 or 256 levels) the codes land within 1/254 of a group's
    largest weight of the stored ones; from Q6_K or F16, as close."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-12)
    codes = (g / scale[..., None]).round_().clamp_(-127, 127)  # one float32 temporary, not three
    return codes.to(torch.int8).reshape(n, k), scale


def quantize_int8(w: torch.Tensor | StoredRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [N, K], float32 scales [N]). `StoredRows` are quantized a
    chunk of rows at a time (no float32 copy of a whole vocabulary)."""
    if isinstance(w, StoredRows):
        q, scale, start = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0]), 0
        for chunk in w.chunks():
            q[start:start + len(chunk)], scale[start:start + len(chunk)] = quantize_int8(chunk)
            start += len(chunk)
        return q, scale
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale

