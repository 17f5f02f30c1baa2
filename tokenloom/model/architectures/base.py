"""What an architecture file provides (`Architecture`) and the GGUF metadata reader they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import ModelConfig, RopeScaling
from .hf_config import hf_rope


class GGUFMetadata:
    """`meta("block_count")` reads `{architecture}.block_count`; a missing key without a default is an
    error naming the file and the key."""

    def __init__(self, reader, path: str, architecture: str):
        self.reader, self.path, self.architecture = reader, path, architecture
        self.tensor_shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # GGML order

    def __call__(self, key: str, default=...):
        full = f"{self.architecture}.{key}"
        f = self.reader.fields.get(full)
        if f is None:
            if default is ...:
                raise ValueError(f"{self.path}: metadata {full!r} is missing")
            return default
        return f.contents()

    def common(self) -> dict:
        """The ModelConfig fields every llama.cpp-style architecture writes the same way."""
        hidden, heads = int(self("embedding_length")), int(self("attention.head_count"))
        vocab = self.tensor_shapes["token_embd.weight"][1] if "token_embd.weight" in self.tensor_shapes else None
        if vocab is None:
            raise ValueError(f"{self.path}: tensor 'token_embd.weight' is missing")
        return {
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": int(self("feed_forward_length")),
            "num_layers": int(self("block_count")), "num_heads": heads,
            "num_kv_heads": int(self("attention.head_count_kv", heads)),
            "rope_theta": float(self("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self("attention.layer_norm_rms_epsilon", 1e-5)),
            "max_position_embeddings": int(self("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensor_shapes,
            "head_dim": int(self("attention.key_length", hidden // heads)), "architecture": self.architecture,
            "rope_scaling": self.rope_scaling()}

    def rope_scaling(self) -> RopeScaling | None:
        """llama.cpp's RoPE scaling: a `rope_freqs` table (what its converter writes for Llama 3's) or a
        linear factor; any other scaling type is refused by name."""
        kind = self("rope.scaling.type", "none") or "none"
        if "rope_freqs.weight" in self.tensor_shapes:
            if kind not in ("none", "linear") or float(self("rope.scaling.factor", 1.0) or 1.0) != 1.0:
                raise ValueError(f"{self.path}: rope_freqs together with rope.scaling.type {kind!r} is not supported")
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            return RopeScaling("freq_factors", freq_factors=tuple(float(v) for v in t.data.reshape(-1)))
        if kind == "none":
            return None
        if kind == "linear":
            return RopeScaling("linear", factor=float(self("rope.scaling.factor")))
        raise ValueError(f"{self.path}: RoPE scaling type {kind!r} ({self.architecture}.rope.scaling.type) "
                         "is not supported")


def hf_common(hf: dict, architecture: str, default_theta: float = 10000.0) -> dict:
    heads = hf["num_attention_heads"]
    theta, scaling = hf_rope(hf, default_theta=default_theta)
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"], "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads),
        "rope_theta": theta, "rope_scaling": scaling, "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False), "head_dim": hf.get("head_dim"),
        "architecture": architecture}


# Hugging Face norm names of a Llama-style layer -> the shared layer's.
LLAMA_HF_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}


@dataclass(frozen=True)
class Architecture:
    name: str  # GGUF general.architecture
    hf_names: tuple[str, ...]  # config.json "architectures" entries
    config_from_gguf: Callable[[GGUFMetadata], ModelConfig]
    config_from_hf: Callable[[dict], ModelConfig]
    # llama.cpp's converter permutes the Q/K rows of these for its interleaved RoPE (undone at load).
    gguf_rope_permuted: bool = False
    # Hugging Face checkpoints store each RMSNorm weight minus this (Gemma: 1; GGUF stores the multiplier).
    hf_norm_offset: float = 0.0
    hf_layer_norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_HF_NORMS))
    # Q/K/V stored as one qkv tensor and gate/up as one (Phi-3; GGUF: attn_qkv, and ffn_up holding both).
    fused_projections: bool = False
