"""GGUF's 4- and 5-bit block formats decoded into the quantized layers' blocks: one weight as a float32
tensor [N, K/32, 34] holding (scale, offset, q_0..q_31) per group of 32 (w = scale * q + offset), every
value exact in float32, rows first, so the loader can unpermute RoPE rows and concatenate Q/K/V exactly
as it does the dequantized weights (gguf_tensors.py). model/quant/layouts.py packs them for the kernels."""

from __future__ import annotations

import torch

from .quant.formats import GROUP


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
