"""`ModelConfig`: what the shared decoder layers need to know about a model, whatever its architecture.

Each architecture (model/architectures/) fills it from a GGUF file's metadata or a Hugging Face
config.json; the layers (model/decoder.py), the KV-cache sizing and the simulator read only this.
The defaults describe a plain Llama: every field past `head_dim` names one way a family differs.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING = "full_attention", "sliding_attention"  # per-layer attention kinds, Hugging Face's names


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    architecture: str = "llama"
    attention_bias: bool = False  # Q, K and V projections carry biases (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of Q and of K before RoPE (Gemma 3, Qwen3)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # the attention and MLP outputs are normed again before the residual add
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sliding_window: int | None = None  # a sliding layer's query sees this many positions, itself included
    layer_types: tuple[str, ...] | None = None  # FULL / SLIDING per layer; None = every layer FULL
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)

    def __post_init__(self):
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, SLIDING}:
                raise ValueError(f"layer_types must give {FULL!r} or {SLIDING!r} for each of {self.num_layers} layers")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_type(self, layer: int) -> str:
        return FULL if self.layer_types is None else self.layer_types[layer]

    def window(self, layer: int) -> int | None:
        """How many positions layer `layer`'s queries see (None: all before them)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_local_theta or self.rope_theta if self.layer_type(layer) == SLIDING else self.rope_theta

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5
