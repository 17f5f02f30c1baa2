"""Qwen2 / Qwen2.5: a Llama with biases on Q, K and V, usually an untied LM head and RoPE base 1e6.
llama.cpp stores its Q/K rows unpermuted (rotate-half RoPE, as Hugging Face)."""

from __future__ import annotations

from ..config import ModelConfig
from .base import Architecture, GGUFMetadata, hf_common


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(**meta.common(), attention_bias=True)


def _from_hf(hf: dict) -> ModelConfig:
    if hf.get("rope_scaling") or hf.get("use_sliding_window"):
        raise ValueError("Qwen2 with rope_scaling or use_sliding_window is not supported yet")
    return ModelConfig(**hf_common(hf, "qwen2"), attention_bias=True)


ARCH = Architecture("qwen2", ("Qwen2ForCausalLM",), _from_gguf, _from_hf)
