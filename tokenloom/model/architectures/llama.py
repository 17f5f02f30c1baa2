"""Llama (SmolLM2, Llama 3.x with its RoPE scaling) and Mistral (a sliding window on every layer): the
plain pre-norm SwiGLU decoder."""

from __future__ import annotations

from ..config import SLIDING, ModelConfig
from .base import Architecture, GGUFMetadata, hf_common
from .hf_config import refuse_unhandled


def sliding_layers(window: int | None, num_layers: int) -> dict:
    """Mistral's window on every layer (none, or one no shorter than the context: every layer full)."""
    return {"sliding_window": window, "layer_types": (SLIDING,) * num_layers} if window else {}


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    common = meta.common()
    return ModelConfig(**common, **sliding_layers(meta("attention.sliding_window", None), common["num_layers"]))


def _from_hf(hf: dict) -> ModelConfig:
    refuse_unhandled(hf, "Llama")
    return ModelConfig(**hf_common(hf, "llama"), **sliding_layers(hf.get("sliding_window"), hf["num_hidden_layers"]))


ARCH = Architecture("llama", ("LlamaForCausalLM", "MistralForCausalLM"), _from_gguf, _from_hf, gguf_rope_permuted=True)
