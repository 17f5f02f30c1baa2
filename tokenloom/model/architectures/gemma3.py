"""Gemma 3 (text): QK-norm, four norms a layer (the attention and MLP outputs normed again), GeGLU,
embeddings scaled by sqrt(hidden), head_dim 256, and five sliding-window layers (RoPE base 10,000)
for every full-attention one (RoPE base 1e6, optionally linearly scaled).

Hugging Face's checkpoints store each norm's weight minus one; GGUF files store the multiplier."""

from __future__ import annotations

from ..config import FULL, SLIDING, ModelConfig
from .base import Architecture, GGUFMetadata, hf_common

PATTERN = 6  # every sixth layer attends to the whole context
LOCAL_ROPE_THETA = 10000.0  # the sliding layers' RoPE base (llama.cpp and transformers hard-code it too)


def layer_types_of(num_layers: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % PATTERN == 0 else SLIDING for i in range(num_layers))


def _gemma_fields(hidden: int, num_layers: int, window: int, head_dim: int) -> dict:
    return {"qk_norm": True, "hidden_act": "gelu_tanh", "sandwich_norms": True, "embedding_scale": hidden**0.5,
                "sliding_window": window, "layer_types": layer_types_of(num_layers), "rope_local_theta": LOCAL_ROPE_THETA,
                "query_pre_attn_scalar": float(head_dim)}


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    if meta("rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{meta.path}: Gemma 3 RoPE scaling is not supported yet")
    common = meta.common()
    return ModelConfig(**common, **_gemma_fields(common["hidden_size"], common["num_layers"],
                                                 int(meta("attention.sliding_window")), common["head_dim"]))


def _from_hf(hf: dict) -> ModelConfig:
    if hf.get("rope_scaling") or hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise ValueError("Gemma 3 with rope_scaling or logit softcapping is not supported yet")
    common = hf_common(hf, "gemma3") | {"tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    fields = _gemma_fields(hf["hidden_size"], hf["num_hidden_layers"], hf["sliding_window"],
                           common["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"])
    if hf.get("layer_types"):
        fields["layer_types"] = tuple(hf["layer_types"])
    fields["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar", fields["query_pre_attn_scalar"]))
    fields["rope_local_theta"] = hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)
    return ModelConfig(**common, **fields)


ARCH = Architecture(
    "gemma3", ("Gemma3ForCausalLM",), _from_gguf, _from_hf, hf_norm_offset=1.0,
    hf_layer_norms={"input_layernorm": "input_layernorm", "post_attention_layernorm": "attn_output_norm",
                    "pre_feedforward_layernorm": "post_attention_layernorm",
                    "post_feedforward_layernorm": "mlp_output_norm"})
