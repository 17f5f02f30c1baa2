"""Phi-3 (mini / medium, the short-context ones): a Llama whose checkpoints store Q/K/V as one tensor
and gate/up as one, with a sliding window on every layer (Phi-3-mini-4k: 2,047). The long-context
variants' `longrope` ("su") scaling switches factors on the running sequence's length and is refused
(model/architectures/hf_config.py), as is a partial rotary factor (Phi-4-mini)."""

from __future__ import annotations

from ..config import ModelConfig
from .base import Architecture, GGUFMetadata, hf_common
from .hf_config import refuse_unhandled
from .llama import sliding_layers


def _from_gguf(meta: GGUFMetadata) -> ModelConfig:
    if "rope_factors_long.weight" in meta.tensor_shapes:
        raise ValueError(f"{meta.path}: Phi-3's longrope scaling (rope_factors_long / rope_factors_short) is not "
                         "supported: its factors switch on the running sequence's length")
    common = meta.common()
    return ModelConfig(**common, **sliding_layers(meta("attention.sliding_window", None), common["num_layers"]))


def _from_hf(hf: dict) -> ModelConfig:
    refuse_unhandled(hf, "Phi-3")
    return ModelConfig(**hf_common(hf, "phi3"), **sliding_layers(hf.get("sliding_window"), hf["num_hidden_layers"]))


ARCH = Architecture("phi3", ("Phi3ForCausalLM",), _from_gguf, _from_hf, fused_projections=True)
