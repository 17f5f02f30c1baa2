"""Qwen2 / Qwen2.5: a Llama with biases on Q, K and V, usually an untied LM head and RoPE base 1e6.
llama.cpp stores its Q/K rows unpermuted (rotate-half RoPE, as Hugging Face)."""

from __future__ import annotations

from ..config import ModelConfig
from .base import Architecture, GGUFMetadata, hf_common
from .hf_config import refuse_unhandled


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    return ModelConfig(**meta.common(), attention_bias=True)


def _from_hf(hf: dict) -> ModelConfig:
    refuse_unhandled(hf, "Qwen2")  # use_sliding_window among them (its window skips the lower layers)
    return ModelConfig(**hf_common(hf, "qwen2"), attention_bias=True)


ARCH = Architecture("qwen2", ("Qwen2ForCausalLM",), _from_gguf, _from_hf)
