"""The weight formats' names: what a `quantization` argument asks for (its names are the engine config's,
`config.QUANTIZATION_NAMES`, defined there once) and the group size every quantized format shares."""

from __future__ import annotations

from ...config import QUANTIZATION_NAMES

GROUP = 32  # GGUF block size = the int4 / int5 / grouped int8 group size


def resolve_quantization(name: str | None) -> str:
    """vLLM-style `quantization` argument -> "none" | "int4" | "int8" (ValueError otherwise)."""
    key = name.lower() if isinstance(name, str) else name
    if key in (None, ""):
        return "none"
    if key not in QUANTIZATION_NAMES:
        raise ValueError(f"quantization must be one of none, int4 (q4), int8, got {name!r}")
    return QUANTIZATION_NAMES[key]
