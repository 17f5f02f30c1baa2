"""Decode attention over the paged KV cache: one query token per sequence, its context found through
its block table. Two implementations of one interface, chosen once at load:

- `TorchDecodeAttention`: gathers each sequence's context slots into a [seqs, longest context] copy
  (padded, masked) and runs SDPA. Always available; the float32 reference path uses it.
- `PagedDecodeAttention`: a small C kernel (csrc/paged_attention.c) that reads K/V in place through
  the block tables, one OpenMP task per (sequence, KV head): no gathered copy, no padding. At 32
  sequences of ~300 tokens the gather and SDPA were 40% of a decode step. Built and checked at first
  use (model/kernels.py); unavailable (no compiler, no AVX2+FMA+F16C, a failed check) -> the torch path,
  with the reason logged.

Both are per-sequence computations: a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import kernels


class TorchDecodeAttention:
    """Gather + SDPA. `prepare` builds the padded slots and mask once a step; every layer reuses them."""

    name = "torch"
    takes_prefill_rows = False  # padded to the longest context: prompt tokens go to SDPA as spans

    def prepare(self, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
        offsets = torch.arange(block_size, device=tables.device)
        slots = (tables[:, :, None] * block_size + offsets).flatten(1)  # [D, max_blocks * block_size]
        mask = torch.arange(slots.shape[1], device=tables.device)[None, :] < context_lens[:, None]
        return slots, mask[:, None, None, :]

    def __call__(self, prepared, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float):
        slots, mask = prepared
        kd = k_cache[slots].to(q.dtype).transpose(1, 2)  # [D, KVH, L, hd]
        vd = v_cache[slots].to(q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)  # [D, H, hd]


class PagedDecodeAttention:
    """The C kernel. q [D, H, hd] float32, caches [slots, KVH, hd] float32 or float16."""

    name = "paged-c"
    takes_prefill_rows = True  # a prompt token is a query with its own context length (the causal mask)

    def __init__(self, lib: ctypes.CDLL, lib512: ctypes.CDLL | None = None):
        """`lib512`: the AVX-512 kernel for head_dim 64 and up to 4 query heads per KV head, when it runs."""
        self._fns = {torch.float32: lib.paged_decode_attention_f32, torch.float16: lib.paged_decode_attention_f16}
        self._fns512 = {} if lib512 is None else {
            torch.float32: lib512.paged_decode_attention_avx512_f32,
            torch.float16: lib512.paged_decode_attention_avx512_f16}
        for fn in [*self._fns.values(), *self._fns512.values()]:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [
                ctypes.c_float, ctypes.c_void_p]
        if self._fns512:
            self.name = "paged-c-avx512"

    def prepare(self, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
        return tables.contiguous(), context_lens.contiguous(), block_size

    def __call__(self, prepared, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float):
        tables, context_lens, block_size = prepared
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        fits512 = head_dim == 64 and num_heads <= 4 * k_cache.shape[1]
        fn = (self._fns512 if fits512 and self._fns512 else self._fns)[k_cache.dtype]
        status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
                          context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[1], head_dim, block_size,
                          scale, out.data_ptr())
        if status != 0:
            raise MemoryError("paged decode attention: out of memory for the score buffer")
        return out


def supports(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    return (dtype == torch.float32 and kv_dtype in (torch.float32, torch.float16) and head_dim % 32 == 0
            and num_heads % num_kv_heads == 0)


def decode_attention_for(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, num_heads: int,
                         num_kv_heads: int, want: bool):
    """The kernel when asked for and usable for this model and cache, else the torch path."""
    if want and supports(dtype, kv_dtype, head_dim, num_heads, num_kv_heads):
        lib = load_kernel()
        if lib is not None:
            return PagedDecodeAttention(lib, kernels.load(SPEC_AVX512))
    return TorchDecodeAttention()


# --- building and checking the kernel (model/kernels.py) ----------------------------------------------


def load_kernel() -> ctypes.CDLL | None:
    return kernels.load(SPEC)


# Run in a child: load the library and compare one small case with a direct computation (no torch, so it
# starts fast). A SIGILL or a wrong answer fails the child, and the parent never loads the library.
_CHECK = r"""
import ctypes, math, random, sys
lib = ctypes.CDLL(sys.argv[1])
fn = lib.paged_decode_attention_f32
fn.restype = ctypes.c_int
fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_void_p]
rng = random.Random(0)
H, KVH, D, BS, NB, CTX = 4, 2, 32, 4, 3, 10
tables = [(i + 2) % NB for i in range(NB)]  # logical block i lives in physical block tables[i]
F = lambda n: (ctypes.c_float * n)(*[rng.uniform(-1, 1) for _ in range(n)])
q, k, v = F(H * D), F(NB * BS * KVH * D), F(NB * BS * KVH * D)
out = (ctypes.c_float * (H * D))()
t = (ctypes.c_int64 * NB)(*tables); lens = (ctypes.c_int64 * 1)(CTX)
assert fn(q, k, v, t, NB, lens, 1, H, KVH, D, BS, ctypes.c_float(0.25), out) == 0
for h in range(H):
    kvh = h // (H // KVH)
    slot = lambda p: tables[p // BS] * BS + p % BS
    s = [0.25 * sum(q[h * D + i] * k[(slot(p) * KVH + kvh) * D + i] for i in range(D)) for p in range(CTX)]
    m = max(s); w = [math.exp(x - m) for x in s]; z = sum(w)
    for i in range(D):
        ref = sum(w[p] / z * v[(slot(p) * KVH + kvh) * D + i] for p in range(CTX))
        assert abs(out[h * D + i] - ref) < 1e-5, (h, i, out[h * D + i], ref)
"""

SPEC = kernels.KernelSpec("paged_attention", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"), _CHECK)
# The same check through the AVX-512 entry point (head_dim 64, 2 query heads per KV head).
SPEC_AVX512 = kernels.KernelSpec(
    "paged_attention_avx512", frozenset({"avx512f", "f16c"}), ("-mavx512f", "-mf16c"),
    _CHECK.replace("paged_decode_attention_f32", "paged_decode_attention_avx512_f32").replace(
        "H, KVH, D, BS, NB, CTX = 4, 2, 32, 4, 3, 10", "H, KVH, D, BS, NB, CTX = 4, 2, 64, 4, 6, 21"))
