"""The int8 KV cache (`--kv-cache-dtype int8`): one scale per token and KV head, written with the token.

Each (slot, KV head) row of an int8 cache is `head_dim` int8 codes followed by the row's scale, a
float32 in SCALE_BYTES bytes (csrc/kernels.h's KV_SCALE_BYTES): value = code * scale, scale = max |x| /
127. Blocks fill a token at a time, so a scale per token needs no re-scaling of what a block already
holds, and a scale per head keeps one head's outlier channels from coarsening another's. A cache
tensor is then [.., slot, kv head, head_dim + SCALE_BYTES] int8: copying whole slots (swap, the prefix
cache's blocks, disaggregated transfer) moves the scales with their codes. The C KV write
(csrc/layer_ops.c's write_kv_q8) and `quantize` do the same float32 operations, so they write the same
bytes; the attention kernels read code * scale, as `dequantize` gives it.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # csrc/kernels.h's KV_SCALE_BYTES


def row_elements(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (slot, KV head) row in a cache of `dtype`: the head, and for int8 the scale's bytes."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    return row_elements(dtype, head_dim) * dtype.itemsize


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] float -> int8 [..., head_dim + SCALE_BYTES]: the codes, then the float32 scale."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    top = torch.full_like(amax, 127.0)
    scale = amax / top
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., head_dim + SCALE_BYTES] -> [..., head_dim] of code * scale (float32), as `dtype`."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] as `dtype` values (an int8 cache's rows dequantized)."""
    rows = cache[slots]
    return dequantize(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)
