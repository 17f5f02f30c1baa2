"""Attention over the paged KV cache for queries that each come alone: a decode token, or (with the
kernel) a prompt token with its own context length, which is the causal mask. Two implementations of
one interface, chosen once at load:

- `TorchDecodeAttention`: gathers each sequence's context slots into a [seqs, longest context] copy
  (padded, masked) and runs SDPA. Always available; the float32 reference path uses it. Prompt tokens
  go to SDPA as spans (`takes_prefill_rows` False).
- `PagedDecodeAttention`: C kernels that read K/V in place through the block tables: no gathered copy,
  no padding. csrc/paged_attention.c (AVX2 + FMA + F16C, any head_dim multiple of 32 up to 256): one
  OpenMP task per (run of rows reading one context, KV head), so each K/V row is converted to float32
  once for the group's query heads and up to 8 of a prompt's tokens; csrc/paged_attention_avx512.c
  (head_dim a multiple of 64 up to 256, up to 8 query heads per KV head): the same tasks, each K/V row
  converted in registers and used there by the query heads of the group and rows of the run, four
  heads at a time (the gather and SDPA grow with the batch's longest context). Both read float32, float16 or int8 caches (int8: each row's codes then its scale,
  model/kv_quant.py; torch's path dequantizes on gather). Built and checked at first use
  (model/kernels.py); unavailable (no compiler, missing CPU flags, a failed check) -> the torch path,
  with the reason logged.

Both are per-query computations: a row's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import kernels, kv_quant

MAX_HEAD_DIM = 256  # csrc/paged_attention.c's float32 tile of K or V rows is sized for it
# csrc/paged_attention_avx512.c: head_dim in panels of 64 (4 registers a head), up to 8 query heads per KV head
AVX512_PANEL, AVX512_MAX_GROUP = 64, 8


def avx512_refuses(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why csrc/paged_attention_avx512.c does not take these shapes (ones paged_attention.c takes), or None."""
    if head_dim % AVX512_PANEL or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (it takes a multiple of {AVX512_PANEL} up to {MAX_HEAD_DIM})"
    if num_heads > AVX512_MAX_GROUP * num_kv_heads:
        return f"{num_heads // num_kv_heads} query heads per KV head (it takes up to {AVX512_MAX_GROUP})"
    return None


def windowed(tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None):
    """(tables, context lengths, block size) for a sliding-window layer's queries: where a context is
    longer than `window`, each row's last `window` positions become a table of single slots (block
    size 1), so an implementation that attends to a whole context reads only the window (and a sliding
    group's released blocks are never among them). Unchanged when every context fits the window."""
    if window is None or int(context_lens.max()) <= window:
        return tables, context_lens, block_size
    lens = context_lens.clamp(max=window)
    # A row within the window reads from position 0 as before (its table past its length is never read,
    # and rows of one short prompt keep equal tables: the kernel shares their task).
    positions = (context_lens - lens)[:, None] + torch.arange(window, device=tables.device)[None, :]
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    return slots, lens, 1


class TorchDecodeAttention:
    """Gather + SDPA. `prepare` builds the padded slots and mask once a step; every layer reuses them."""

    name = "torch"
    takes_prefill_rows = False  # padded to the longest context: prompt tokens go to SDPA as spans

    def prepare(self, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None = None):
        """`window`: each query sees only its last `window` positions (a sliding-window layer)."""
        tables, context_lens, block_size = windowed(tables, context_lens, block_size, window)
        offsets = torch.arange(block_size, device=tables.device)
        slots = (tables[:, :, None] * block_size + offsets).flatten(1)  # [D, max_blocks * block_size]
        keys = torch.arange(slots.shape[1], device=tables.device)[None, :]
        return slots, (keys < context_lens[:, None])[:, None, None, :]

    def __call__(self, prepared, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float):
        slots, mask = prepared
        kd = kv_quant.gather(k_cache, slots, q.dtype).transpose(1, 2)  # [D, KVH, L, hd]
        vd = kv_quant.gather(v_cache, slots, q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)  # [D, H, hd]


class PagedDecodeAttention:
    """The C kernel. q [D, H, hd] float32, caches [slots, KVH, hd] float32 or float16, or int8 rows of
    hd codes and their scale (model/kv_quant.py)."""

    name = "paged-c"
    takes_prefill_rows = True  # a prompt token is a query with its own context length (the causal mask)

    def __init__(self, lib: ctypes.CDLL, lib512: ctypes.CDLL | None = None):
        """`lib512`: the AVX-512 kernel, when it runs, for the shapes it takes (`avx512_refuses`)."""
        self._fns = {torch.float32: lib.paged_decode_attention_f32, torch.float16: lib.paged_decode_attention_f16,
                     torch.int8: lib.paged_decode_attention_q8}
        self._fns512 = {} if lib512 is None else {
            torch.float32: lib512.paged_decode_attention_avx512_f32,
            torch.float16: lib512.paged_decode_attention_avx512_f16,
            torch.int8: lib512.paged_decode_attention_avx512_q8}
        if self._fns512:
            self.name = "paged-c-avx512"

    def prepare(self, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None = None):
        """Once a step: the kernel reads a context through its table, so no context may outrun it.
        `window`: each query sees only its last `window` positions (a sliding-window layer)."""
        tables, context_lens, block_size = windowed(tables, context_lens, block_size, window)
        tables, context_lens = tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous()
        if len(context_lens) != len(tables) or bool((context_lens > tables.shape[1] * block_size).any()):
            raise ValueError("paged attention: a context is longer than its block table")
        return tables, context_lens, block_size

    def kernel_for(self, num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype):
        """The ctypes function for these shapes over a `cache_dtype` cache, or None."""
        fns = self._fns512 if self._fns512 and avx512_refuses(num_heads, num_kv_heads, head_dim) is None else self._fns
        return fns.get(cache_dtype)

    def __call__(self, prepared, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float):
        tables, context_lens, block_size = prepared
        fn = self.kernel_for(q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.dtype)
        if (fn is None or q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype or q.shape[0] != len(tables)
                or k_cache.shape[-1] != kv_quant.row_elements(k_cache.dtype, q.shape[-1])
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise ValueError(f"paged attention kernel: no kernel for {q.dtype} queries over a "
                             f"{k_cache.dtype} cache (load the model with the KV cache dtype it will serve)")
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
                    context_lens.data_ptr(), num_seqs, num_heads, k_cache.shape[1], head_dim, block_size,
                    scale, out.data_ptr())
        if status == -2:
            raise ValueError(f"paged attention kernel: head_dim {head_dim} with {num_heads} heads is not supported")
        if status != 0:
            raise MemoryError("paged decode attention: out of memory for the score buffer")
        return out


# --- the plan's strategies (model/plan.py asks each in turn, the first that can implement runs) --------


def _dtype(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def _paged_fits(needs) -> str | None:
    """Why csrc/paged_attention.c cannot serve `needs` (plan.ForwardNeeds), or None."""
    if needs.exact:
        return needs.exact
    if needs.dtype != torch.float32:
        return f"{_dtype(needs.dtype)} queries (it takes float32)"
    if needs.kv_dtype not in (torch.float32, torch.float16, torch.int8):
        return f"a {_dtype(needs.kv_dtype)} KV cache (it reads float32, float16 or int8)"
    if needs.head_dim % 32 or needs.head_dim > MAX_HEAD_DIM:
        return f"head_dim {needs.head_dim} (it takes a multiple of 32 up to {MAX_HEAD_DIM})"
    if needs.num_heads % needs.num_kv_heads:
        return f"{needs.num_heads} query heads over {needs.num_kv_heads} KV heads (it takes whole groups)"
    return None


def _paged_avx512_fits(needs) -> str | None:
    """Why csrc/paged_attention_avx512.c cannot serve `needs`, or None."""
    return _paged_fits(needs) or avx512_refuses(needs.num_heads, needs.num_kv_heads, needs.head_dim)


class PagedStrategy:
    """A paged C kernel: the shapes it takes (`fits`) and the libraries it needs (the AVX-512 one is built
    beside the AVX2 one, as `PagedDecodeAttention` takes them)."""

    def __init__(self, name: str, fits, specs: tuple[kernels.KernelSpec, ...]):
        self.name, self._fits, self._specs = name, fits, specs

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        reason = self._fits(needs)
        for spec in self._specs:
            if reason is None:
                reason = cpu.library(spec)[1]
        return reason is None, reason

    def build(self, needs, cpu: kernels.CPU) -> PagedDecodeAttention:
        return PagedDecodeAttention(*(cpu.library(spec)[0] for spec in self._specs))


class TorchStrategy:
    name = TorchDecodeAttention.name

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        return True, None

    def build(self, needs, cpu: kernels.CPU) -> TorchDecodeAttention:
        return TorchDecodeAttention()


# --- building and checking the kernel (model/kernels.py) ----------------------------------------------


def load_kernel() -> ctypes.CDLL | None:
    return kernels.load(SPEC)


# csrc/checks/paged_attention.c: two rows of a prompt over a float, a half and an int8 cache, at a few head_dims
# and GQA groups, against a direct computation.
SPEC = kernels.KernelSpec("paged_attention", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"),
                          check="paged_attention")
# The same check through the AVX-512 entry points (head_dim 64 to 256, 1 to 8 query heads per KV head).
SPEC_AVX512 = kernels.KernelSpec("paged_attention_avx512", frozenset({"avx512f", "f16c"}), ("-mavx512f", "-mf16c"),
                                 check="paged_attention", check_flags=("-DAVX512",))


STRATEGIES = (PagedStrategy("paged-c-avx512", _paged_avx512_fits, (SPEC, SPEC_AVX512)),
              PagedStrategy("paged-c", _paged_fits, (SPEC,)), TorchStrategy())  # in order of preference
