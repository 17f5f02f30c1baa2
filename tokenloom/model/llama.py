"""A Llama-family decoder written for one flat, variable-length batch per step.

Read top to bottom: config → RMSNorm → RoPE → attention over the paged KV cache → SwiGLU MLP →
decoder layer → model. A forward takes the tokens of many sequences concatenated (prefill chunks and
single decode tokens together) plus a `ForwardBatch` saying where each token's K/V goes in the paged
cache (`slot_mapping`) and which cache slots each sequence attends to. Decode tokens come first in the
flat batch, then short prefill chunks, then long ones: the first `decode_like_rows` rows are few per
sequence, the rest are long chunks, and a projection may send the two groups to different kernels
(model/linear.py: int4 for the former, dense bfloat16 for the latter). Attention takes the first
`num_decodes` rows one query at a time through the paged decode attention (decode tokens; every token
when the C kernel runs) and the rest as prefill spans through SDPA. Nothing is padded. The LM head
runs only on `logits_indices`.

The math mirrors Hugging Face's LlamaForCausalLM operation by operation (RMSNorm in float32,
rotate-half RoPE, scaled-dot-product attention, SiLU-gated MLP), so float32 output matches it token
for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layer_ops import TORCH_OPS, TorchLayerOps
from .paged_attention import TorchDecodeAttention


@dataclass(frozen=True)
class LlamaConfig:
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

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass
class PrefillSpan:
    """One sequence whose query has more than one token (a prefill chunk) in this step."""

    query_start: int  # index of its first token in the flat batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] cache slots it attends to (earlier chunks + this one)
    causal_mask: torch.Tensor | None  # [query_len, context_len] bool, None when context == query


@dataclass
class ForwardBatch:
    """Everything attention needs to find the paged K/V of every sequence in the flat batch."""

    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) each new K/V is written to
    # Rows [0, D) of the flat batch are queried one token at a time through the paged decode attention:
    # decode tokens, and prompt tokens too when it `takes_prefill_rows` (each with its own context length).
    num_decodes: int
    decode_like_rows: int  # rows [0, R), R >= D: decodes and short prefill chunks (runner.SHORT_CHUNK)
    decode_block_tables: torch.Tensor  # [D, max blocks] each such row's sequence's block table (zero-padded)
    decode_context_lens: torch.Tensor  # [D] context length of each such query (its own token included)
    block_size: int
    prefills: list[PrefillSpan]
    logits_indices: torch.Tensor  # [S] flat indices whose hidden state goes through the LM head


class Linear(nn.Linear):
    """A dense projection. Projections take the number of leading decode-like rows so that quantized
    ones (model/linear.py) can run them and long prefill chunks through different kernels; a dense one
    needs not."""

    def forward(self, x: torch.Tensor, decode_like_rows: int | None = None) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    ops: TorchLayerOps = TORCH_OPS  # set per model at load (LlamaModel.layer_ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin precomputed for every position, looked up once per forward
    (`forward`) and applied in every layer to Q and K together (`layer_ops.rope`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim], for the tokens at `positions`."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Attention(nn.Module):
    ops: TorchLayerOps = TORCH_OPS  # set per model at load (LlamaModel.layer_ops)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.dim_per_head
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) of this step's positions
        decode,  # (decode attention, what it prepared for this step), see model/paged_attention.py
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim] (a view of this layer's blocks)
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], batch.num_decodes
        qkv = self.qkv_proj(x, batch.decode_like_rows)
        # RoPE on Q and K in one go: they sit side by side in the fused projection's output.
        qk = self.ops.rope(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # Write the new K/V first: every query then reads its whole context from the cache,
        # including tokens of its own chunk and blocks shared with other sequences in this step.
        self.ops.write_kv(k, v, batch.slot_mapping, k_cache, v_cache)

        out = torch.empty_like(q) if batch.prefills else None
        if d:
            attend, prepared = decode
            od = attend(prepared, q[:d], k_cache, v_cache, self.scale)  # [D, H, hd]
            if out is None:
                out = od
            else:
                out[:d] = od
        for span in batch.prefills:
            # 4-D [1, heads, tokens, head_dim]: SDPA's CPU flash kernel (3-D inputs take the math path,
            # which materialises the whole score matrix: 2.7x slower for 512 queries over 6,000 keys).
            qs = q[span.query_start : span.query_start + span.query_len].transpose(0, 1)[None]
            ks = k_cache[span.context_slots].to(qs.dtype).transpose(0, 1)[None]  # [1, KVH, C, hd]
            vs = v_cache[span.context_slots].to(qs.dtype).transpose(0, 1)[None]
            os_ = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=span.causal_mask,
                is_causal=span.causal_mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[span.query_start : span.query_start + span.query_len] = os_[0].transpose(0, 1)
        return self.o_proj(out.reshape(num_tokens, self.q_size), batch.decode_like_rows)


class MLP(nn.Module):
    ops: TorchLayerOps = TORCH_OPS  # set per model at load (LlamaModel.layer_ops)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, decode_like_rows: int) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x, decode_like_rows)), decode_like_rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, batch, rope, decode, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), batch, rope, decode, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), batch.decode_like_rows)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.dim_per_head, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.logits_proj: nn.Module | None = None  # a quantized LM head (model/linear.py), when chosen
        self.decode_attention = TorchDecodeAttention()  # or the paged C kernel, chosen at load
        self.kv_cache_dtype: torch.dtype | None = None  # None: the activations' dtype; set at load
        self.layer_ops = TORCH_OPS  # or the C ones (model/layer_ops.py), chosen at load
        self.decoder_loop = None  # all layers in one C call when every row takes the C kernels (set at load)

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self._layer_ops

    @layer_ops.setter
    def layer_ops(self, ops: TorchLayerOps) -> None:
        self._layer_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden states of all tokens, float32 logits at `batch.logits_indices`)."""
        x = self.embed_tokens(input_ids)
        rope = self.rope(batch.positions, x.dtype)
        decode = None
        if batch.num_decodes:
            attend = self.decode_attention
            decode = attend, attend.prepare(batch.decode_block_tables, batch.decode_context_lens, batch.block_size)
        if self.decoder_loop is not None and self.decoder_loop.applies(self, x, batch):
            x = self.decoder_loop(x, batch, rope, decode[1], kv_caches)
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                x = layer(x, batch, rope, decode, k_cache, v_cache)
        x = self.norm(x)
        return x, self.compute_logits(x[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
