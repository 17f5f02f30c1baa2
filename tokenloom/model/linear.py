"""Weight formats behind one linear layer, chosen once at load time.

- dense (default): the GGUF weights dequantized to float32 (or cast to `dtype`), `F.linear`.
- int4: weight-only 4-bit straight from the GGUF's Q4_1 blocks (w = d*q + m per block of 32, q in
  0..15), by the first of these that runs here (`quant_gemm()`, `detect()`):
  - the C kernels csrc/quant_gemm.c (AVX-512 VNNI) and csrc/quant_gemm_avx2.c (AVX2 + FMA): float32
    in and out, the activations rounded to int8 per group of 32 (llama.cpp's Q8_0; an input over 6x
    its group's mean magnitude kept in float32 instead: csrc/quant_rows.h), integer dot products
    against the exact codes (vpdpbusd, vpmaddubsw), y = W times the rounded x per group, Q4_1's own
    float16 d and m: the two kernels give the same bits;
  - torch's `aten._weight_int4pack_mm_for_cpu` with bfloat16 activations (vectorised on x86 only for
    bfloat16): scale = d, zero = m + 8*d (the op computes (q - 8) * scale + zero); bit-exact against
    the dequantized weights with float32 scales (tests/test_fast_paths.py).
- int8: per-output-channel int8 (C kernel, else `torch._weight_int8pack_mm`), requantized from the
  dense weights; grouped (a scale per group of 32: the projections a GGUF stores wider than 5 bits) on
  the C kernels, on AVX-512 by VNNI over the int4 kernels' int8 activations.
- int4 + dense prefill (`quantize_model(dense_prefill=True)`; no longer what `auto` loads): int4 for
  decode rows and short prefill chunks, the same weights dequantized to bfloat16 for long prefill
  chunks through oneDNN. With today's kernels it made a 512-token prompt only 5-6% faster, for a
  bfloat16 copy of every weight (1.5x a Q4 file's size). A row's kernel depends on its own
  sequence's chunk length (runner.SHORT_CHUNK), never on the rest of the batch. (Int8 activations
  without their outliers cost 6 points of top-1 agreement; the kernels' int8 groups of 32 keep
  outliers in float32 and cost under 1 point: tests/test_fast_paths.py.)
- the LM head (`RescoredHead`): int4 logits over the vocabulary (int8 without the C kernels), then the
  best candidates of each row recomputed exactly in float32: the argmax is the float32 head's, the
  rest within the scan's error. A greedy row's argmax alone comes from a scan that keeps each row's
  best few values and never stores its logits (`RescoredHead.argmax`, the kernels' `int4_top`).

Every kernel here gives each row of the output the same bits whatever the number of rows (checked
in the tests), so greedy decoding stays batch-invariant as long as one format serves all batch sizes.
"""

from __future__ import annotations

import abc
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, vocab_select
from .gguf_tensors import StoredRows
from .heap import trim_heap
from .kernels import cpu_flags  # also what the benchmarks record the CPU flags from
from .layer_ops import fitting

logger = logging.getLogger(__name__)

GROUP = 32  # GGUF block size = int4 group size
QUANTIZATIONS = ("none", "int4", "int8")
_ALIASES = {None: "none", "": "none", "none": "none", "q4": "int4", "int4": "int4", "q4_1": "int4", "q8": "int8", "int8": "int8"}


def resolve_quantization(name: str | None) -> str:
    """vLLM-style `quantization` argument -> "none" | "int4" | "int8" (ValueError otherwise)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _ALIASES:
        raise ValueError(f"quantization must be one of none, int4 (q4), int8, got {name!r}")
    return _ALIASES[key]


# --- Q4_1 blocks ------------------------------------------------------------------------------------
# One weight's blocks as a float32 tensor [N, K/32, 34]: (d, m, q_0..q_31) per block, every value exact
# in float32, rows first, so the loader can unpermute RoPE rows and concatenate Q/K/V exactly as it
# does the dequantized weights.


def q4_1_blocks(data, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF Q4_1 bytes of a [N, K] weight -> [N, K/32, 34] float32 blocks (d, m, codes)."""
    import numpy as np

    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, 20)
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    m = raw[:, 2:4].contiguous().view(torch.float16).float()
    packed = raw[:, 4:]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=1).float()  # low nibbles first, then high
    n, k = shape
    return torch.cat([d, m, codes], dim=1).view(n, k // GROUP, 2 + GROUP)


def q4_0_blocks(data, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF Q4_0 bytes (w = d * (q - 8)) -> the same (d, m, codes) blocks, with m = -8d."""
    import numpy as np

    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, 18)
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    codes = torch.cat([raw[:, 2:] & 0xF, raw[:, 2:] >> 4], dim=1).float()
    n, k = shape
    return torch.cat([d, -8 * d, codes], dim=1).view(n, k // GROUP, 2 + GROUP)


def q4_k_blocks(data, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF Q4_K bytes -> (d, m, codes) blocks of 32. A Q4_K super-block of 256 weights holds eight such
    groups, each w = (d * sc) * q - (dmin * mn) with 6-bit sc and mn: a group's scale and offset are
    those products (rounded to float16 by the kernels' packing, 2^-11 of the scale)."""
    import numpy as np
    from gguf.quants import Q4_K

    raw = np.array(data, dtype=np.uint8).reshape(-1, 144)
    nb = raw.shape[0]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16].copy())
    # Each 32 bytes of codes hold two groups: the low nibbles, then the high ones.
    qs = raw[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = torch.from_numpy((qs & 0x0F).reshape(nb, 8, 32).astype(np.float32))
    scale = torch.from_numpy(d * sc.astype(np.float32))[..., None]
    offset = torch.from_numpy(-dmin * mn.astype(np.float32))[..., None]
    n, k = shape
    return torch.cat([scale, offset, codes], dim=-1).view(n, k // GROUP, 2 + GROUP)


def q5_0_blocks(data, shape: tuple[int, int]) -> torch.Tensor:
    """GGUF Q5_0 bytes (w = d * (q - 16), q in 0..31: a float16 d, 32 fifth bits, 16 bytes of nibbles per
    32 weights) -> (d, -16d, codes) blocks: the int5 kernels' (the int4 ones' plus a plane of fifth bits)."""
    import numpy as np

    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(-1, 22)
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    fifth = (raw[:, 2:6].contiguous().view(torch.int32)[:, :1] >> torch.arange(32)) & 1
    codes = (torch.cat([raw[:, 6:] & 0xF, raw[:, 6:] >> 4], dim=1).int() | (fifth.int() << 4)).float()
    n, k = shape
    return torch.cat([d, -16 * d, codes], dim=1).view(n, k // GROUP, 2 + GROUP)


# The GGUF block formats whose weights are 4- or 5-bit codes with a scale and an offset per group of 32:
# the int4 / int5 kernels take them as they are. Wider formats (Q6_K, Q8_0, F16, ...) take the int8 path.
LOW_BIT_BLOCKS = {"Q4_0": q4_0_blocks, "Q4_1": q4_1_blocks, "Q4_K": q4_k_blocks, "Q5_0": q5_0_blocks}


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
    the symmetric formats' (Q4_0, Q5_0), which the kernels compute instead of reading (Qwen2.5-0.5B's
    Q5_0 layers: 14 MB less to keep)."""
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


class QuantGemm:
    """ctypes front of csrc/quant_gemm.c (AVX-512) or csrc/quant_gemm_avx2.c (AVX2 + FMA): float32
    x [M, K] -> float32 [M, N] over int4 or int8 weights."""

    def __init__(self, lib, name: str, pack_int4=pack_c_layout, pack_int8g=pack_int8_c_layout):
        """`pack_int4`: blocks -> (codes, fifth bits or None, scales, offsets) in the layout this library's
        int4_gemm / int5_gemm read; `pack_int8g`: int8 codes [N, K] -> its int8g_gemm's."""
        import ctypes

        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.name, self.pack_int4, self.pack_int8g = name, pack_int4, pack_int8g
        self._int4, self._int5 = lib.int4_gemm, lib.int5_gemm
        self._int8, self._int8g = lib.int8_gemm, lib.int8g_gemm
        self._int4.argtypes = [p, i64, i64, p, p, p, i64, p]
        self._int5.argtypes = [p, i64, i64, p, p, p, p, i64, p]
        self._int8.argtypes = self._int8g.argtypes = [p, i64, i64, p, p, i64, p]
        self._int4.restype = self._int5.restype = self._int8.restype = self._int8g.restype = ctypes.c_int
        self._int4_top = lib.int4_top
        self._int4_top.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, p, p, p]
        self._int4_top.restype = ctypes.c_int

    @staticmethod
    def _activations(x: torch.Tensor, k: int, op: str) -> torch.Tensor:
        """`x` as the kernels take it (float32 [rows, k], contiguous), else a ValueError naming `op`."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"{op}: x must be float32 [rows, {k}], got {x.dtype} {tuple(x.shape)}")
        return x.contiguous()

    @staticmethod
    def _run(fn, x: torch.Tensor, k: int, n: int, *weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a float32 [rows, n] buffer to write into where it fits (layer_ops.fitting), else a new one."""
        x = QuantGemm._activations(x, k, "quantized gemm")
        out = fitting(out, (x.shape[0], n), torch.float32)
        if out is None:
            out = _output_buffer(x.shape[0], n)
        pointers = (None if w is None else w.data_ptr() for w in weights)  # None: NULL (offsets of symmetric codes)
        if x.shape[0] and fn(x.data_ptr(), x.shape[0], x.shape[1], *pointers, n, out.data_ptr()):
            raise MemoryError("quantized gemm: out of memory for the activation buffer")
        return out

    def int4(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
             fifth: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """4-bit codes, or 5-bit ones with their `fifth` bits (int5_gemm); `offsets` None for symmetric codes."""
        k, n = codes.shape[1] * GROUP, codes.shape[0] * 16
        if fifth is not None:
            return self._run(self._int5, x, k, n, codes, fifth, scales, offsets, out=out)
        return self._run(self._int4, x, k, n, codes, scales, offsets, out=out)

    def int4_top(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's `keep` largest outputs of `int4(x, codes, scales, offsets)`, the outputs never stored
        whole: (values [rows, slots * keep], their columns int64, a bool per row that met a NaN), each
        thread's lists side by side (largest first, -inf / -1 where a list is not full)."""
        rows, k, n, slots = x.shape[0], codes.shape[1] * GROUP, codes.shape[0] * 16, torch.get_num_threads()
        x = self._activations(x, k, "int4_top")
        values = torch.full((slots, rows, keep), float("-inf"))
        ids = torch.full((slots, rows, keep), -1, dtype=torch.int32)
        unordered = torch.zeros(slots, rows, dtype=torch.uint8)
        if self._int4_top(x.data_ptr(), rows, k, codes.data_ptr(), scales.data_ptr(),
                          None if offsets is None else offsets.data_ptr(), n, keep, slots, values.data_ptr(),
                          ids.data_ptr(), unordered.data_ptr()):
            raise MemoryError("int4_top: out of memory for the activation buffer")
        values, ids = (t.transpose(0, 1).reshape(rows, slots * keep) for t in (values, ids))
        return values, ids.long(), unordered.any(0)

    def int8(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-column scales [N] (per_column_int8) or a scale per group of 32 inputs [N/16, K/32, 16]
        (grouped_int8)."""
        fn = self._int8 if scales.dim() == 1 else self._int8g
        return self._run(fn, x, codes.shape[1] * codes.shape[3], codes.shape[0] * 16, codes, scales, out=out)


# Outputs of at least this many bytes are allocated for a whole multiple of OUTPUT_ROWS_STEP rows.
LARGE_OUTPUT_BYTES = 1 << 20
OUTPUT_ROWS_STEP = 16


def _output_buffer(rows: int, n: int) -> torch.Tensor:
    """A float32 [rows, n] output. A large one (the LM head's logits: 600 KB a row on a 151k vocabulary)
    comes from an allocation rounded up to a multiple of OUTPUT_ROWS_STEP rows: a batch of 31 rows, then
    33, then 32 reuses the block the last one freed, where blocks of every size fragmented glibc's heap
    (measured on Qwen2.5-0.5B at 32 streams: +16 MB resident per new size)."""
    if rows * n * 4 < LARGE_OUTPUT_BYTES:
        return torch.empty(rows, n, dtype=torch.float32)
    padded = -(-rows // OUTPUT_ROWS_STEP) * OUTPUT_ROWS_STEP
    return torch.empty(padded, n, dtype=torch.float32)[:rows]


def _quant_gemm_check(code_bytes: str) -> str:
    """The child-process check of a quant_gemm library whose int4 codes `code_bytes` (Python source of
    `code_bytes(q, N, G)`, q[n][k] the codes) lays out."""
    return code_bytes + _CHECK_INT4 + _CHECK_INT4_TOP + _CHECK_INT5 + _CHECK_INT8 + _CHECK_INT8G


_CODE_BYTES_C = r"""
INT8G_INPUTS = 4  # pack_int8_quads
def code_bytes(q, N, G):  # pack_c_layout: byte 4c + p of quarter jq, inputs 8jq + p (low nibble) and 8jq + 4 + p
    return bytearray((q[nb * 16 + c][g * 32 + 8 * jq + p] & 15) | (q[nb * 16 + c][g * 32 + 8 * jq + 4 + p] & 15) << 4
                     for nb in range(N // 16) for g in range(G) for jq in range(4) for c in range(16) for p in range(4))
def fifth_bytes(q, N, G):  # its fifth bits: uint64 per (block, group, jq, h), bit 4c + p
    words = (sum((q[nb * 16 + c][g * 32 + 8 * jq + 4 * h + p] >> 4) << (4 * c + p) for c in range(16) for p in range(4))
             for nb in range(N // 16) for g in range(G) for jq in range(4) for h in range(2))
    return bytearray(b"".join(w.to_bytes(8, "little") for w in words))
"""
_CODE_BYTES_AVX2 = r"""
INT8G_INPUTS = 2  # pack_int8_c_layout
def code_bytes(q, N, G):  # pack_avx2_layout: byte 4c + p of slot jj, columns c (low nibble) and 8 + c
    return bytearray((q[nb * 16 + c][g * 32 + 4 * jj + p] & 15) | (q[nb * 16 + 8 + c][g * 32 + 4 * jj + p] & 15) << 4
                     for nb in range(N // 16) for g in range(G) for jj in range(8) for c in range(8) for p in range(4))
def fifth_bytes(q, N, G):  # its fifth bits: plane h, byte 4c + p, bit b that of code vector 8h + b (slot b // 2, half b % 2)
    return bytearray(sum((q[nb * 16 + 8 * (b % 2) + c][g * 32 + 4 * (4 * h + b // 2) + p] >> 4) << b for b in range(8))
                     for nb in range(N // 16) for g in range(G) for h in range(2) for c in range(8) for p in range(4))
"""


_CHECK_INT4 = r"""
import ctypes, random, struct, sys
lib = ctypes.CDLL(sys.argv[1])
fn = lib.int4_gemm
fn.restype = ctypes.c_int
fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
rng = random.Random(0)
M, K, N = 5, 64, 48
G = K // 32
bf16 = lambda v: struct.unpack("<f", struct.pack("<I", (struct.unpack("<I", struct.pack("<f", v))[0] + 0x8000) & 0xFFFF0000))[0]
half = lambda v: struct.unpack("<e", struct.pack("<e", v))[0]
x = [rng.randrange(-127, 128) / 64 for _ in range(M * K)]
for i in range(0, M * K, 32):  # each group's largest 127/64: the values exact in bfloat16 and in int16 or int8 groups
    x[i] = rng.choice([-127, 127]) / 64
for r in range(M):  # an outlier in group 1 (over 6x its mean magnitude), which the int8 groups leave out
    x[r * K + 39] = rng.choice([-64.0, 64.0])
q = [[rng.randrange(16) for _ in range(K)] for _ in range(N)]
d = [[half(rng.uniform(0.01, 0.1)) for _ in range(G)] for _ in range(N)]
m = [[half(rng.uniform(-0.5, 0)) for _ in range(G)] for _ in range(N)]
codes = code_bytes(q, N, G)
pack = lambda t: b"".join(struct.pack("<e", t[nb * 16 + c][g]) for nb in range(N // 16) for g in range(G) for c in range(16))
cbuf = (ctypes.c_uint8 * len(codes)).from_buffer(codes)
sbuf, obuf = ctypes.create_string_buffer(pack(d)), ctypes.create_string_buffer(pack(m))
xbuf = (ctypes.c_float * (M * K))(*x)
y = (ctypes.c_float * (M * N))()
assert fn(xbuf, M, K, cbuf, sbuf, obuf, N, y) == 0
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * (d[n][k // 32] * q[n][k] + m[n][k // 32]) for k in range(K))
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), (r, n, y[r * N + n], ref)
assert fn(xbuf, M, K, cbuf, sbuf, None, N, y) == 0  # symmetric codes: the offset is -8 d
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * d[n][k // 32] * (q[n][k] - 8) for k in range(K))
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), ("symmetric", r, n, y[r * N + n], ref)
"""
_CHECK_INT5 = r"""
fn5 = lib.int5_gemm
fn5.restype = ctypes.c_int
fn5.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
q5 = [[rng.randrange(32) for _ in range(K)] for _ in range(N)]
codes5, fifth5 = code_bytes(q5, N, G), fifth_bytes(q5, N, G)
assert fn5(xbuf, M, K, (ctypes.c_uint8 * len(codes5)).from_buffer(codes5), (ctypes.c_uint8 * len(fifth5)).from_buffer(fifth5),
           sbuf, obuf, N, y) == 0
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * (d[n][k // 32] * q5[n][k] + m[n][k // 32]) for k in range(K))
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), ("int5", r, n, y[r * N + n], ref)
assert fn5(xbuf, M, K, (ctypes.c_uint8 * len(codes5)).from_buffer(codes5), (ctypes.c_uint8 * len(fifth5)).from_buffer(fifth5),
           sbuf, None, N, y) == 0  # symmetric codes: the offset is -16 d
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * d[n][k // 32] * (q5[n][k] - 16) for k in range(K))
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), ("int5 symmetric", r, n, y[r * N + n], ref)
"""
_CHECK_INT4_TOP = r"""
top = lib.int4_top
top.restype = ctypes.c_int
top.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
assert fn(xbuf, M, K, cbuf, sbuf, obuf, N, y) == 0
KEEP, SLOTS = 4, 2
vals = (ctypes.c_float * (SLOTS * M * KEEP))(*([float("-inf")] * (SLOTS * M * KEEP)))
ids = (ctypes.c_int32 * (SLOTS * M * KEEP))(*([-1] * (SLOTS * M * KEEP)))
nan = (ctypes.c_uint8 * (SLOTS * M))()
assert top(xbuf, M, K, cbuf, sbuf, obuf, N, KEEP, SLOTS, vals, ids, nan) == 0
assert not any(nan)
for r in range(M):  # each thread's list of its columns: merged, the row's KEEP largest, with their columns
    kept = sorted(((vals[(s * M + r) * KEEP + j], ids[(s * M + r) * KEEP + j]) for s in range(SLOTS) for j in range(KEEP)),
                  reverse=True)[:KEEP]
    assert [v for v, _ in kept] == sorted(y[r * N:(r + 1) * N], reverse=True)[:KEEP], ("int4_top", r, kept)
    assert all(y[r * N + i] == v for v, i in kept), ("int4_top ids", r, kept)
"""
_CHECK_INT8 = r"""
fn8 = lib.int8_gemm
fn8.restype = ctypes.c_int
fn8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
w8 = [[rng.randrange(-127, 128) for _ in range(K)] for _ in range(N)]
s8 = [rng.uniform(0.001, 0.01) for _ in range(N)]
c8 = bytearray(w8[nb * 16 + c][2 * j + i] & 0xFF for nb in range(N // 16) for j in range(K // 2) for c in range(16) for i in range(2))
assert fn8(xbuf, M, K, (ctypes.c_uint8 * len(c8)).from_buffer(c8), (ctypes.c_float * N)(*s8), N, y) == 0
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * w8[n][k] for k in range(K)) * struct.unpack("<f", struct.pack("<f", s8[n]))[0]
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), (r, n, y[r * N + n], ref)
"""
_CHECK_INT8G = r"""
fn8g = lib.int8g_gemm
fn8g.restype = ctypes.c_int
fn8g.argtypes = fn8.argtypes
g8 = [[rng.uniform(0.001, 0.01) for _ in range(G)] for _ in range(N)]
gs = (ctypes.c_float * (N * G))(*[g8[nb * 16 + c][g] for nb in range(N // 16) for g in range(G) for c in range(16)])
c8g = bytearray(w8[nb * 16 + c][INT8G_INPUTS * j + i] & 0xFF for nb in range(N // 16) for j in range(K // INT8G_INPUTS)
                for c in range(16) for i in range(INT8G_INPUTS))
assert fn8g(xbuf, M, K, (ctypes.c_uint8 * len(c8g)).from_buffer(c8g), gs, N, y) == 0
for r in range(M):
    for n in range(N):
        ref = sum(x[r * K + k] * w8[n][k] * struct.unpack("<f", struct.pack("<f", g8[n][k // 32]))[0] for k in range(K))
        assert abs(y[r * N + n] - ref) < 1e-4 * (1 + abs(ref)), (r, n, y[r * N + n], ref)
"""


SPEC_AVX512 = kernels.KernelSpec(
    "quant_gemm", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c"}),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"),
    _quant_gemm_check(_CODE_BYTES_C))
SPEC_AVX2 = kernels.KernelSpec("quant_gemm_avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"),
                               _quant_gemm_check(_CODE_BYTES_AVX2))


@functools.cache
def quant_gemm_avx512() -> QuantGemm | None:
    """The AVX-512 kernels (csrc/quant_gemm.c: int4 / int5 and grouped int8 by VNNI over the activations
    rounded to int8 per group of 32, per-column int8 by BF16 dot products) where they build and pass
    their check."""
    lib = kernels.load(SPEC_AVX512)
    return QuantGemm(lib, "c-avx512", pack_c_layout, pack_int8_quads) if lib is not None else None


@functools.cache
def quant_gemm_avx2() -> QuantGemm | None:
    """The AVX2 + FMA int4 and int8 kernels (csrc/quant_gemm_avx2.c: activations rounded to int8 per group
    of 32 for int4 / int5 codes, to int16 for int8) where they build and pass their check."""
    lib = kernels.load(SPEC_AVX2)
    return QuantGemm(lib, "c-avx2", pack_avx2_layout) if lib is not None else None


def quant_gemm() -> QuantGemm | None:
    """The fastest C kernels that run here: AVX-512 (VNNI and BF16), else AVX2, else None (torch's ops)."""
    return quant_gemm_avx512() or quant_gemm_avx2()


def onednn_packed(w: torch.Tensor) -> torch.Tensor:
    """`w` in oneDNN's own blocked layout (as torch.compile's freezing does), for long prefill chunks:
    the matmul then stops re-laying out the weight on every call (a 128-token prefill's matmuls
    39.4 -> 37.2 ms, the same bits). The plain weight where this torch has no oneDNN."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 128)  # 128: the row count it is tuned for
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN weight packing unavailable (%s); plain weights for long prefill chunks", exc)
        return w


class SplitRowsLinear(nn.Module, metaclass=abc.ABCMeta):
    """A quantized projection: rows [0, decode_like_rows) (decodes and short prompt slices) through the
    quantized kernel (`_quantized`), the rest (long prompt chunks) through `dense`, the weights in
    bfloat16 packed for oneDNN, when it is kept (None: every row quantized); the bias added after."""

    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # float32 (set by quantize_model)

    @abc.abstractmethod
    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The quantized kernel's output for rows `x` (each weight format its own), in `out` where the C
        kernels run."""

    def _long(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dense.dtype)
        if self.dense.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.dense, None, "none", [], "")
        return F.linear(x, self.dense)

    @property
    def rows_independent(self) -> bool:
        """Each output row's bits come from its input row alone, whatever rows share the call (the C
        kernels; not oneDNN's dense bfloat16 path nor torch's int4 op)."""
        return self.dense is None and getattr(self, "kernel", None) is not None

    def forward(self, x: torch.Tensor, decode_like_rows: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a float32 [rows, out_features] buffer the C kernels write into; the result is returned
        either way (a new tensor where another path runs)."""
        rows = x.shape[0]
        d = rows if self.dense is None or decode_like_rows is None else decode_like_rows
        if d >= rows:
            out = self._quantized(x, out)
        elif d == 0:
            out = self._long(x)
        else:
            # Joined in float32: a decode row keeps the bits it has in a step without long chunks.
            out = torch.cat([self._quantized(x[:d]).float(), self._long(x[d:]).float()])
        return _with_bias(out if out.dtype == x.dtype else out.to(x.dtype), self.bias)


class Int4Linear(SplitRowsLinear):
    def __init__(self, blocks: torch.Tensor, dtype: torch.dtype, dense_prefill: bool = False,
                 kernel: QuantGemm | None = None):
        """`kernel`: the C kernels (quant_gemm()), or None for torch's `_weight_int4pack_mm_for_cpu`.
        `dense_prefill`: also keep the weights dequantized to `dtype` for long prefill chunks."""
        super().__init__()
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * GROUP
        self.kernel = kernel if self.out_features % 16 == 0 else None
        if self.kernel is not None:
            codes, fifth, scales, offsets = self.kernel.pack_int4(blocks)
            self.register_buffer("codes", codes)
            self.register_buffer("fifth", fifth)  # None: 4-bit codes (int4_gemm), else int5_gemm
            self.register_buffer("scales", scales)
            self.register_buffer("offsets", offsets)  # None: symmetric codes (Q4_0, Q5_0)
            self.compute_dtype = torch.float32
        else:
            if blocks[..., 2:].max() > 15:
                raise ValueError("5-bit codes need the C kernels (torch's int4 op takes 4 bits)")
            packed, sz = pack_int4(blocks, dtype)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", sz)
            self.compute_dtype = dtype
        self.dense = onednn_packed(dequantize_blocks(blocks).to(dtype)) if dense_prefill else None

    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        if self.kernel is not None:
            return self.kernel.int4(x, self.codes, self.scales, self.offsets, self.fifth, out=out)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    @property
    def bits(self) -> int:
        return 5 if getattr(self, "fifth", None) is not None else 4

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel is not None else "torch"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, "
                f"bits={self.bits}, kernel={kernel}")


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The projection's bias added in place (the output is this call's own tensor)."""
    return out if bias is None else out.add_(bias.to(out.dtype))


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


class Int8Linear(SplitRowsLinear):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, kernel: QuantGemm | None = None,
                 grouped: bool = False, dense_prefill: bool = False):
        """`kernel`: the C kernels (quant_gemm()), or None for torch's `_weight_int8pack_mm` (per-column
        scales only). `grouped`: a scale per group of 32 inputs (the projections), else per column (the
        LM head, rescored anyway). `dense_prefill`: also keep `weight` in `dtype` for long prefill chunks."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel if self.out_features % 16 == 0 and self.in_features % 32 == 0 else None
        self.grouped = grouped and self.kernel is not None
        q, scale = quantize_int8_grouped(weight) if self.grouped else quantize_int8(weight)
        if self.kernel is not None:
            self.register_buffer("codes", self.kernel.pack_int8g(q) if self.grouped else pack_int8_c_layout(q))
            if self.grouped:  # [N/16, K/32, 16] float32: each column block's 16 scales per group
                scale = scale.reshape(self.out_features // 16, 16, -1).transpose(1, 2)
            self.register_buffer("scales", scale.float().contiguous())
        else:
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(dtype))
        self.dense = onednn_packed(weight.to(dtype)) if dense_prefill else None

    def _quantized(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.int8(x.float(), self.codes, self.scales, out=out)
        dt = self.scales.dtype
        return torch._weight_int8pack_mm(x if x.dtype == dt else x.to(dt), self.qweight, self.scales)


class RescoredHead(nn.Module):
    """The LM head in a few bits for the whole vocabulary, then each row's `top` best candidates
    recomputed exactly from the float32 weight (`weight`, shared with the embedding; `StoredRows` reads
    those rows from the file). The scan is the head's biggest read of a decode step: in int4 (on the C
    kernels: `int4_head`) it is half int8's bytes, 72 MB instead of 136 for Qwen2.5's 151k rows. On
    its own an int8 head flips ~4% of near-tie argmaxes on natural text, int4 more; rescored, the
    argmax is the float32 head's whenever it is among the scan's top `top` (the gap it must bridge is
    the scan's rounding noise), and the other logits are the scan's, within its error."""

    def __init__(self, approx: nn.Module, weight: torch.Tensor | StoredRows, top: int = 16):
        super().__init__()
        self.approx = approx
        self.weight = weight
        self.top = top

    @property
    def format(self) -> str:
        return f"int{self.approx.bits}" if isinstance(self.approx, Int4Linear) else "int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scan = self.approx
        logits = scan(x if getattr(scan, "kernel", None) is not None else x.to(torch.bfloat16)).float()
        idx = vocab_select.topk_indices(logits, min(self.top, logits.shape[-1]))  # [rows, top]
        return logits.scatter_(1, idx, self._exact(x, idx))

    def _exact(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The float32 logits of rows `x` at vocabulary ids `idx` [rows, n]. An elementwise product and a
        sum: each row's result is the same whatever the number of rows (and whatever the ids' order)."""
        return (self.weight[idx].float() * x.float().unsqueeze(1)).sum(-1)

    @property
    def scans(self) -> bool:
        """Does `argmax` find float32 rows' argmax without their logits (the C kernels' int4 scan)?"""
        approx = self.approx
        return (isinstance(approx, Int4Linear) and approx.kernel is not None and approx.bits == 4
                and approx.out_features >= self.top + 2)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of `forward(x)` (the first on a tie), without its [rows, vocab] logits (18.5 MB
        on 32 rows of a 151k vocabulary): the C kernels' `int4_top` scans the vocabulary keeping each
        row's top + 2 largest values. Those decide alone when the top-th and the next two differ: the
        candidates are then the one top set `forward` rescores, and the best other id is one too, so the
        argmax is the better of the best rescored candidate and that id's scan value. A row where they
        tie (or that met a NaN) takes `forward`'s own path, and so do rows in another dtype than float32
        (`forward` rounds their scan to it)."""
        scan, keep, k = self.approx, self.top + 2, self.top
        if not self.scans or x.dtype != torch.float32 or not x.shape[0]:
            return vocab_select.argmax(self.forward(x))
        x = x.contiguous()
        values, ids, unordered = scan.kernel.int4_top(x, scan.codes, scan.scales, scan.offsets, keep)
        best, order = values.topk(keep, dim=1)  # each thread's lists merged: [rows, top + 2], largest first
        best_ids = ids.gather(1, order)
        candidates, other, other_id = best_ids[:, :k], best[:, k], best_ids[:, k]
        # A list left short (-1: a NaN row) reads row 0; such a row ties at -inf or met a NaN: unsure below.
        exact = self._exact(x, candidates.clamp_min(0))
        top = exact.amax(1)
        first_top = torch.where(exact == top[:, None], candidates, scan.out_features).amin(1)  # argmax's tie rule
        token = torch.where(other > top, other_id,
                            torch.where(other == top, torch.minimum(first_top, other_id), first_top))
        unsure = (unordered | (best[:, k - 1] == other) | (other == best[:, k + 1]) | exact.isnan().any(1)).nonzero()
        if len(unsure):
            rows = unsure.flatten()
            token[rows] = vocab_select.argmax(self.forward(x[rows]))
        return token


def int4_head(weight: torch.Tensor | StoredRows, kernel: QuantGemm, rows: int = 2048) -> Int4Linear | None:
    """The head's scan as Int4Linear on the C kernels, quantized `rows` rows at a time (no float32 copy
    of a whole vocabulary), the chunks' packed buffers stacked (the kernels' layout is in blocks of 16
    rows); None where a chunk's rows do not fill the kernels' blocks. In Q4_1's codes: symmetric ones
    (Q4_0's, 8 MB less for a 151k vocabulary) still ranked Qwen2.5-0.5B's float32 argmax within the
    top 5, but the scan's values are the logits outside the rescored few, and Gemma 3's KL against
    float32 rose past 0.02 (0.025 over 2,500 positions)."""
    chunks = weight.chunks(rows) if isinstance(weight, StoredRows) else weight.split(rows)
    parts = []
    for chunk in chunks:
        if chunk.shape[0] % 16:
            return None
        parts.append(Int4Linear(q4_1_from_dense(chunk), torch.bfloat16, kernel=kernel))
        del chunk
        trim_heap()  # a chunk's float32 temporaries (several times its packed size) back to the OS
    head = parts[0]
    for part in parts:  # a chunk of all-zero rows reads as symmetric; the stacked head keeps every offset
        if part.offsets is None:
            part.offsets = part.scales * -8
    for name in ("codes", "scales", "offsets"):
        setattr(head, name, torch.cat([getattr(part, name) for part in parts]))
    head.out_features = sum(part.out_features for part in parts)
    return head


# --- start-up detection -----------------------------------------------------------------------------


@functools.cache
def detect() -> dict:
    """What runs here, found by running tiny ops (never assumed from the CPU model): the C kernels, and
    only where they do not pass, torch's own quantized ops (`torch_quant_ops`: their first calls left
    5 MB in a loaded Qwen2.5-0.5B that never calls them again); plus torch's ISA choice and CPU flags."""
    flags = set(cpu_flags())
    found: dict = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }
    kernel = quant_gemm()
    found["int4_kernel"] = kernel.name if kernel is not None else "torch"
    if kernel is not None:
        x, _, blocks = _probe_case()
        _probe(found, "int4_c", lambda: Int4Linear(blocks, torch.bfloat16, kernel=kernel)(x),
               x @ dequantize_blocks(blocks).t())
        found["int8_c"] = found["int4_c"]  # one library: its check ran the int8 kernels too
    # The C kernels read a quarter of float32's bytes and passed their check: int4 whatever a timing says
    # (a timing taken while the machine is busy measured them 30x slower than they are). Torch's own int4
    # op takes bf16 activations; where bf16 is emulated it can lose to float32, so without the C kernels
    # "auto" takes int4 only where a decode-sized matmul measured faster than float32 here.
    if found.get("int4_c"):
        found["fast_int4"] = True
    else:
        found |= torch_quant_ops()
        found["int4_speedup_b1"] = _int4_speedup(None) if found["int4_bf16"] else 0.0
        found["fast_int4"] = found["int4_speedup_b1"] > 1.2
    return found


@functools.cache
def torch_quant_ops() -> dict:
    """Which of torch's own ops run here and give the right answer: int4 and int8 with bfloat16
    activations, bfloat16 dense."""
    found: dict = {}
    x, w, blocks = _probe_case()
    _probe(found, "int4_bf16", lambda: Int4Linear(blocks, torch.bfloat16)(x.bfloat16()), x @ dequantize_blocks(blocks).t())
    _probe(found, "int8_bf16", lambda: Int8Linear(w, torch.bfloat16)(x.bfloat16()), x @ w.t())
    _probe(found, "bf16_dense", lambda: F.linear(x.bfloat16(), w.bfloat16()), x @ w.t())
    return found


def _probe_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, w, w's Q4_1 blocks) of the detection's tiny matmuls, the same every call."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    w = torch.randn(64, 64, generator=gen) * 0.1
    return x, w, q4_1_from_dense(w)


def _probe(found: dict, name: str, fn, expected: torch.Tensor) -> None:
    """found[name]: does `fn()` run and come within 5% of `expected` (its error as name_error if it raises)."""
    try:
        found[name] = bool(torch.allclose(fn().float(), expected, rtol=0.05, atol=0.05))
    except Exception as exc:  # noqa: BLE001 - op missing in this build, unsupported dtype, ...
        found[name] = False
        found[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]


def _int4_speedup(kernel: QuantGemm | None, layers: int = 24) -> float:
    """float32 time / int4 time of a decode row through `layers` MLP-sized weights (1536 x 576), more
    float32 bytes (85 MB) than a CPU cache holds, as in a real forward; best of 5 passes (~0.1 s)."""
    import time

    gen = torch.Generator().manual_seed(1)
    dense = [torch.randn(1536, 576, generator=gen) * 0.05 for _ in range(layers)]
    quant = [Int4Linear(q4_1_from_dense(w), torch.bfloat16, kernel=kernel) for w in dense]
    x = torch.randn(1, 576, generator=gen)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(lambda: [F.linear(x, w) for w in dense])
    return fp32 / max(best(lambda: [layer(x) for layer in quant]), 1e-9)


def choose(quantization: str | None, dtype: str) -> tuple[str, str]:
    """(quantization, dtype) to load with. "auto" -> int4 where int4 with bf16 activations runs and
    measured faster than float32, else none. An explicit int4/int8 that does not run here falls back
    to dense with a warning. `dtype` is the residual stream's: "float32" keeps it in float32 (the C
    kernels take it as is; torch's int4/int8 ops get bfloat16 casts around them), "bfloat16" runs
    everything in bfloat16 (fewest ops, lower quality)."""
    cap = detect()
    if quantization == "auto":
        runs = cap.get("int4_c") or cap["int4_bf16"]
        return ("int4", dtype) if runs and cap["fast_int4"] else ("none", dtype)
    method = resolve_quantization(quantization)
    if method == "none":
        return method, dtype
    if not (cap.get(f"{method}_bf16") or cap.get(f"{method}_c")):
        logger.warning("quantization %s does not run on this CPU/torch (%s); using dense weights", method, cap)
        return "none", dtype
    return method, dtype


def quantize_model(model: nn.Module, method: str, blocks: dict[str, torch.Tensor] | None = None,
                   lm_head: str = "dense", dense_prefill: bool = False, wider_as_int8: bool = False,
                   weights: dict | None = None) -> nn.Module:
    """Swap the decoder's linear layers for `method` ("int4" | "int8"). `blocks` maps a weight name
    (e.g. "layers.0.mlp.gate_up_proj.weight") to its 4- or 5-bit blocks as the file stores them (5-bit:
    Q5_0, on the C kernels' int5; without them, int8 grouped); int4 layers
    without blocks are quantized from the dense weight, or, with `wider_as_int8` (a GGUF whose weight
    came in a wider format: re-quantizing Q6_K/Q8_0 to 4 bits costs Qwen2.5-0.5B 9% of its top-1
    agreement), to int8 with a scale per group of 32 (per column cost Gemma 3 2.5%). `dense_prefill` (int4): prefill rows use the weights dequantized
    to bfloat16. The LM head (tied embedding) stays dense, or lm_head="int8" (plain) / "rescored".
    `weights` (the loader's deferred ones): a builder of each projection's float32 weight, whose module
    is still on the meta device, and "lm_head.weight", the head's (a tensor or `StoredRows`)."""
    blocks = blocks or {}
    weights = dict(weights or {})
    dtype = torch.bfloat16  # the dtype torch's int4/int8 ops are vectorised for
    # The C kernels only if they also gave the right answer in this process (detect()).
    kernel = quant_gemm() if detect().get("int4_c") else None
    # One projection at a time, holding no reference to the ones replaced: each float32 weight is freed as
    # its quantized form is built (a list of the modules kept every float32 weight alive to the end).
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name != "lm_head"]
    for name in names:
        module = model.get_submodule(name)
        dense = weights.pop(name + ".weight", None) or (lambda m=module: m.weight)
        b = None
        if method == "int4":
            b = blocks.pop(name + ".weight", None)
            b = b() if callable(b) else b  # the loader hands the file's blocks over as builders
            if b is not None and (kernel is None or b.shape[0] % 16) and b[..., 2:].max() > 15:
                b, dense = None, (lambda blocks=b: dequantize_blocks(blocks))  # 5-bit codes: the C kernels only
            if b is None and wider_as_int8:
                new: nn.Module = Int8Linear(dense(), dtype, kernel, grouped=True, dense_prefill=dense_prefill)
            else:
                new = Int4Linear(q4_1_from_dense(dense()) if b is None else b, dtype, dense_prefill, kernel)
        elif method == "int8":
            new = Int8Linear(dense(), dtype, kernel)
        else:
            raise ValueError(method)
        new.bias = None if module.bias is None else module.bias.detach().float().contiguous()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        del module, dense, b, new
        trim_heap()  # the float32 temporaries' pages back to the OS now, not after the last projection
    head = weights.pop("lm_head.weight", None)
    if head is None:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if lm_head == "int8":
        model.logits_proj = Int8Linear(head, dtype, kernel)
    elif lm_head == "rescored":
        scan = int4_head(head, kernel) if kernel is not None else None
        model.logits_proj = RescoredHead(scan if scan is not None else Int8Linear(head, dtype, kernel), head)
    elif lm_head != "dense" or isinstance(head, StoredRows):
        raise ValueError(f"lm_head: {lm_head!r}" + (" (a head left in the file needs int8 or rescored)"
                                                     if lm_head == "dense" else ""))
    return model
