"""`ModelConfig`: what the shared decoder layers need to know about a model, whatever its architecture.

Each architecture (model/architectures/) fills it from a GGUF file's metadata or a Hugging Face
config.json; the layers (model/decoder.py), the KV-cache sizing and the simulator read only this.
The defaults describe a plain Llama: every field past `head_dim` names one way a family differs.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING = "full_attention", "sliding_attention"  # per-layer attention kinds, Hugging Face's names
ROPE_SCALINGS = ("linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE's frequencies are stretched past the context the model was trained on (transformers'
    `rope_type`; model/rope.py computes each). Only the fields of `kind` are read."""

    kind: str  # one of ROPE_SCALINGS; "freq_factors" is a GGUF's rope_freqs table (llama.cpp's llama3)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by this
    truncate: bool = True  # yarn: the correction range rounded outwards
    freq_factors: tuple[float, ...] = ()  # freq_factors: each frequency divided by its factor

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")


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
    rope_local_theta: float | None = None  # the sliding layers' own unscaled RoPE base (None: the full layers')
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    rope_scaling: RopeScaling | None = None  # the full-attention layers' (sliding layers never scale)

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

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(outputs, inputs) of each layer's projections as the model holds them (QKV and gate/up fused)."""
        d, q, kv = self.dim_per_head, self.num_heads, self.num_kv_heads
        return {"qkv": ((q + 2 * kv) * d, self.hidden_size), "o": (self.hidden_size, q * d),
                "gate_up": (2 * self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size)}

    def layer_type(self, layer: int) -> str:
        return FULL if self.layer_types is None else self.layer_types[layer]

    def window(self, layer: int) -> int | None:
        """How many positions layer `layer`'s queries see (None: all before them)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of layer `layer`'s RoPE: the key its cos/sin are computed under."""
        if self.layer_type(layer) == SLIDING and self.rope_local_theta is not None:
            return self.rope_local_theta, None  # Gemma 3: the sliding layers' own, unscaled RoPE
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5
