"""Llama (and SmolLM2, Mistral without sliding windows): the plain pre-norm SwiGLU decoder."""

from __future__ import annotations

from ..config import ModelConfig
from .base import Architecture, GGUFMetadata, hf_common


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    if "rope_freqs.weight" in meta.tensor_shapes or meta("rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{meta.path}: RoPE scaling (rope_freqs / rope.scaling) is not supported yet")
    return ModelConfig(**meta.common())


def _from_hf(hf: dict) -> ModelConfig:
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported yet")
    return ModelConfig(**hf_common(hf, "llama"))


ARCH = Architecture("llama", ("LlamaForCausalLM", "MistralForCausalLM"), _from_gguf, _from_hf, gguf_rope_permuted=True)
