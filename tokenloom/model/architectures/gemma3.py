"""Gemma 3 (text): QK-norm, four norms a layer (the attention and MLP outputs normed again), GeGLU,
embeddings scaled by sqrt(hidden), head_dim 256, and five sliding-window layers (RoPE base 10,000)
for every full-attention one (RoPE base 1e6, linearly scaled in the larger models).

Hugging Face's checkpoints store each norm's weight minus one; GGUF files store the multiplier."""

from __future__ import annotations

from ..config import FULL, SLIDING, ModelConfig
from .base import Architecture, GGUFMetadata, hf_common
from .hf_config import hf_rope, refuse_unhandled

PATTERN = 6  # every sixth layer attends to the whole context
LOCAL_ROPE_THETA = 10000.0  # the sliding layers' RoPE base when a file does not say (both projects' default)


def layer_types_of(num_layers: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % PATTERN == 0 else SLIDING for i in range(num_layers))


def _gemma_fields(hidden: int, num_layers: int, window: int, head_dim: int) -> dict:
    return {"qk_norm": True, "hidden_act": "gelu_tanh", "sandwich_norms": True, "embedding_scale": hidden**0.5,
                "sliding_window": window, "layer_types": layer_types_of(num_layers), "rope_local_theta": LOCAL_ROPE_THETA,
                "query_pre_attn_scalar": float(head_dim)}


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    common = meta.common()
    fields = _gemma_fields(common["hidden_size"], common["num_layers"], int(meta("attention.sliding_window")),
                           common["head_dim"])
    return ModelConfig(**common, **fields | {"rope_local_theta": float(meta("rope.freq_base_swa", LOCAL_ROPE_THETA))})


def _from_hf(hf: dict) -> ModelConfig:
    refuse_unhandled(hf, "Gemma 3", handled={"hidden_act"})
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json: hidden_activation={act!r} is not supported for Gemma 3")
    common = hf_common(hf, "gemma3", default_theta=1e6) | {"tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    fields = _gemma_fields(hf["hidden_size"], hf["num_hidden_layers"], hf["sliding_window"],
                           common["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"])
    if hf.get("layer_types"):
        fields["layer_types"] = tuple(hf["layer_types"])
    fields["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar", fields["query_pre_attn_scalar"]))
    fields["rope_local_theta"], local_scaling = hf_rope(hf, SLIDING, default_theta=LOCAL_ROPE_THETA,
                                                        legacy_theta_key="rope_local_base_freq", legacy_scaled=False)
    if local_scaling is not None:
        raise ValueError("config.json: a scaled RoPE on Gemma 3's sliding layers is not supported")
    return ModelConfig(**common, **fields)


ARCH = Architecture(
    "gemma3", ("Gemma3ForCausalLM",), _from_gguf, _from_hf, hf_norm_offset=1.0,
    hf_layer_norms={"input_layernorm": "input_layernorm", "post_attention_layernorm": "attn_output_norm",
                    "pre_feedforward_layernorm": "post_attention_layernorm",
                    "post_feedforward_layernorm": "mlp_output_norm"})
