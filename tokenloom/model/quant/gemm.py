"""The quantized GEMMs' front: the ctypes bindings of csrc/quant_gemm.c (AVX-512: VNNI and BF16) and
csrc/quant_gemm_avx2.c (AVX2 + FMA), and which of them runs here (`quant_gemm()`: the first that builds
and passes its check, csrc/checks/quant_gemm.c). Float32 activations in and out, the activations rounded
to int8 per group of 32 (llama.cpp's Q8_0; an input over 6x its group's mean magnitude kept in float32
instead: csrc/quant_rows.h), integer dot products against the exact codes (vpdpbusd, vpmaddubsw),
y = W times the rounded x per group with the blocks' own float16 scales and offsets: the two libraries
give the same bits, and each row of the output the same bits whatever the number of rows."""

from __future__ import annotations

import functools

import torch

from .. import kernels
from ..layer_ops import fitting
from .formats import GROUP
from .layouts import pack_avx2_layout, pack_c_layout, pack_int8_c_layout, pack_int8_quads


def why_not(out_features: int, in_features: int) -> str | None:
    """Why the C kernels cannot take a weight of this shape (None: they can): they run blocks of 16
    outputs over groups of GROUP inputs. The loader gives such a weight torch's op instead, and the plan's
    line says so."""
    if out_features % 16:
        return f"{out_features} outputs, not a multiple of 16"
    if in_features % GROUP:
        return f"{in_features} inputs, not a multiple of {GROUP}"
    return None


def kernel_for_shape(kernel, out_features: int, in_features: int):
    """`kernel` for a weight of this shape where it takes it, else None (torch's op): the loader's rule,
    also the packed-weight cache's when it rebuilds a module."""
    return kernel if kernel is not None and why_not(out_features, in_features) is None else None


class QuantGemm:
    """ctypes front of csrc/quant_gemm.c (AVX-512) or csrc/quant_gemm_avx2.c (AVX2 + FMA): float32
    x [M, K] -> float32 [M, N] over int4 or int8 weights."""

    def __init__(self, lib, name: str, pack_int4=pack_c_layout, pack_int8g=pack_int8_c_layout):
        """`pack_int4`: blocks -> (codes, fifth bits or None, scales, offsets) in the layout this library's
        int4_gemm / int5_gemm read; `pack_int8g`: int8 codes [N, K] -> its int8g_gemm's. `lib` as kernels.load
        gives it: its functions typed from csrc/kernels.h."""
        self.name, self.pack_int4, self.pack_int8g = name, pack_int4, pack_int8g
        self._int4, self._int5 = lib.int4_gemm, lib.int5_gemm
        self._int8, self._int8g = lib.int8_gemm, lib.int8g_gemm
        self._int4_top = lib.int4_top

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
    (the servers' resident memory at 32 streams: benchmarks/results/peers-*/)."""
    if rows * n * 4 < LARGE_OUTPUT_BYTES:
        return torch.empty(rows, n, dtype=torch.float32)
    padded = -(-rows // OUTPUT_ROWS_STEP) * OUTPUT_ROWS_STEP
    return torch.empty(padded, n, dtype=torch.float32)[:rows]


SPEC_AVX512 = kernels.KernelSpec(
    "quant_gemm", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c"}),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"),
    check="quant_gemm")  # csrc/checks/quant_gemm.c, codes in pack_c_layout's order
SPEC_AVX2 = kernels.KernelSpec("quant_gemm_avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"),
                               check="quant_gemm", check_flags=("-DAVX2_LAYOUT",))  # in pack_avx2_layout's


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

