"""RoPE's inverse frequencies for each scaling a checkpoint can ask for (`RopeScaling.kind`).

Each is computed with the same float32 operations in the same order as transformers' own
(`modeling_rope_utils`), so the angles, and with them greedy tokens, agree exactly. A scaling only
changes the frequencies (and, for YaRN, one factor on cos and sin): the kernels that apply RoPE take
cos/sin and never know which it was. Everything is made on the CPU, also while the loader builds the
model on the meta device.

Not here on purpose: "dynamic" NTK and "longrope", whose frequencies depend on the length of the
sequence being run: the same position would get other angles in another batch.
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], factor on cos and sin) of one RoPE."""
    inv_freq = default_inv_freq(head_dim, theta)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling), scaling.attention_factor
    if scaling.kind == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32, device="cpu")
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors, 1.0
    raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between blended."""
    old_context = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: high frequencies extrapolated, low ones interpolated by `factor`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """The cos/sin factor YaRN uses when a checkpoint does not give one (transformers' rule)."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)
