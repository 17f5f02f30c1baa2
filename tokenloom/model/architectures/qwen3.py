"""Qwen3 (dense): a Llama with an RMSNorm over each head's queries and keys before RoPE (QK-norm), no
biases, an explicit head_dim (128 in the released models, wider than hidden / heads in the small ones)
and a tied or untied head. llama.cpp stores its Q/K rows unpermuted (rotate-half RoPE)."""

from __future__ import annotations

from ..config import ModelConfig
from .base import Architecture, GGUFMetadata, hf_common
from .hf_config import refuse_unhandled


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(**meta.common(), qk_norm=True)


def _from_hf(hf: dict) -> ModelConfig:
    refuse_unhandled(hf, "Qwen3")
    return ModelConfig(**hf_common(hf, "qwen3"), qk_norm=True)


ARCH = Architecture("qwen3", ("Qwen3ForCausalLM",), _from_gguf, _from_hf)
