"""The decoder layers every architecture shares, written for one flat, variable-length batch per step.

Read top to bottom: RMSNorm → RoPE → attention over the paged KV cache → gated MLP → decoder layer →
model. What a family does differently (biases, QK-norm, GeGLU, sandwich norms, embedding scale,
sliding-window layers with their own RoPE base) is a field of `ModelConfig` (model/config.py) that
a layer reads once when it is built; model/architectures/ fills the config and names the weights. A forward takes the tokens of many sequences concatenated (prefill chunks and
single decode tokens together) plus a `ForwardBatch` saying where each token's K/V goes in the paged
cache (`slot_mapping`) and which cache slots each sequence attends to. Decode tokens come first in the
flat batch, then short prefill chunks, then long ones: the first `decode_like_rows` rows are few per
sequence, the rest are long chunks, and a projection may send the two groups to different kernels
(model/quant/: int4 for the former, dense bfloat16 for the latter). Attention takes the first
`num_decodes` rows one query at a time through the paged decode attention (decode tokens; every token
when the C kernel runs) and the rest as prefill spans through SDPA. Nothing is padded. The LM head
runs only on `logits_indices`.

The math mirrors Hugging Face's Llama, Qwen2 and Gemma 3 models operation by operation (RMSNorm in
float32, rotate-half RoPE, scaled-dot-product attention, gated MLP), so float32 output matches them
token for token (tests/test_architectures.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import kv_quant, vocab_select
from .config import ModelConfig, RopeScaling
from .kv_layout import KVLayout
from .layer_ops import TORCH_OPS, TorchLayerOps
from .lora import LoRABatch
from .paged_attention import TorchDecodeAttention
from .rope import inv_frequencies


@dataclass
class PrefillSpan:
    """One sequence whose query has more than one token (a prefill chunk) in this step."""

    query_start: int  # index of its first token in the flat batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] cache slots it attends to (earlier chunks + this one)
    causal_mask: torch.Tensor | None  # [query_len, context_len] bool, None when context == query
    # The position of context_slots[0]: 0, or for a sliding-window group the first position the span's
    # first query reads (the context starts there, and its mask comes from the window).
    context_start: int = 0


@dataclass
class GroupSlots:
    """Where the layers of a KV group other than the first find their K/V (model/kv_layout.py): the
    batch's `slot_mapping`, `decode_block_tables` and prefill spans' `context_slots`, through that
    group's block tables."""

    slot_mapping: torch.Tensor
    decode_block_tables: torch.Tensor
    context_slots: list[torch.Tensor]  # per prefill span, in the batch's order
    context_starts: list[int]  # per prefill span: the position of its context_slots[0]


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
    lora: LoRABatch | None = None  # rows under LoRA adapters, added to each projection's output
    # KV groups 1, 2, ...; the fields above are group 0's. Empty: every layer finds its K/V at the same
    # slots (one group, or a batch built by hand with a cache per layer).
    other_groups: tuple[GroupSlots, ...] = ()

    def for_group(self, group: int) -> ForwardBatch:
        """The batch as the layers of KV group `group` see it."""
        if group == 0 or not self.other_groups:
            return self
        slots = self.other_groups[group - 1]
        spans = [replace(span, context_slots=c, context_start=start)
                 for span, c, start in zip(self.prefills, slots.context_slots, slots.context_starts, strict=True)]
        return replace(self, slot_mapping=slots.slot_mapping, decode_block_tables=slots.decode_block_tables,
                       prefills=spans, other_groups=())


class Linear(nn.Linear):
    """A dense projection. Projections take the number of leading decode-like rows so that quantized
    ones (model/quant/) can run them and long prefill chunks through different kernels; a dense one
    needs not."""

    rows_independent = False  # a row's bits may depend on how many rows share the matmul (oneDNN's blocking)

    def forward(self, x: torch.Tensor, decode_like_rows: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` is for the quantized kernels' buffers; torch's op here makes its own (its bits: F.linear's)."""
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """`weight` is the multiplier itself (Gemma's checkpoints store it minus one; the loader adds it back)."""

    ops: TorchLayerOps = TORCH_OPS  # set per model at load (DecoderModel.layer_ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: cos/sin computed once per forward for the step's positions (`forward`) and applied
    in every layer to Q and K together (`layer_ops.rope`). Not a table over every position: that is
    2 x max_positions x head_dim floats per RoPE, where a step's own rows cost microseconds. Each
    position's values are the same whatever else is in the step (the same float32 product, then cos and
    sin elementwise). `key` is the (base, scaling) the layers look it up by (`ModelConfig.layer_rope`)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        # On the CPU even where the model is built on the meta device (loader.py): the frequencies are
        # computed, not loaded, and torch's meta-device ops import torch._dynamo and sympy (75 MB).
        inv_freq, self.attention_factor = inv_frequencies(head_dim, theta, scaling)
        self.key = (theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim], for the tokens at `positions`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def window_mask(query_positions: torch.Tensor, context_start: int, context_len: int, window: int) -> torch.Tensor:
    """[queries, context] bool over the context's positions context_start, context_start + 1, ...: key
    position j is seen by the query at position p when p - window < j <= p."""
    keys = torch.arange(context_start, context_start + context_len, device=query_positions.device)[None, :]
    p = query_positions[:, None]
    return (keys <= p) & (keys > p - window)


class Attention(nn.Module):
    ops: TorchLayerOps = TORCH_OPS  # set per model at load (DecoderModel.layer_ops)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.dim_per_head
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Q, K and V in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale
        self.window = cfg.window(layer)  # None: the whole context
        self.rope_key = cfg.layer_rope(layer)

    def _normed_heads(self, qkv: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Q and K as [T, heads + kv_heads, head_dim], each head RMS-normed (QK-norm)."""
        qk = qkv[:, : self.q_size + self.kv_size].reshape(num_tokens, -1, self.head_dim)
        q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
        k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
        return torch.cat([q.view(num_tokens, self.num_heads, -1), k.view(num_tokens, self.num_kv_heads, -1)], 1)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) of this step's positions for this layer's base
        decode,  # (decode attention, what it prepared for this step), see model/paged_attention.py
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim] (a view of this layer's blocks)
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, d = x.shape[0], batch.num_decodes
        qkv = self.qkv_proj(x, batch.decode_like_rows)
        if batch.lora is not None:
            batch.lora.add(self.ops, self.layer, "qkv", x, qkv)
        if self.q_norm is None:  # RoPE on Q and K in one go: they sit side by side in the projection's output
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        else:
            qk = self._normed_heads(qkv, num_tokens)
        qk = self.ops.rope(qk, *rope)
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
            mask, causal = span.causal_mask, span.causal_mask is None
            if self.window is not None and (span.context_start or len(span.context_slots) > self.window):
                positions = batch.positions[span.query_start : span.query_start + span.query_len]
                mask = window_mask(positions, span.context_start, len(span.context_slots), self.window)
                causal = False
            # 4-D [1, heads, tokens, head_dim]: SDPA's CPU flash kernel (3-D inputs take the math path,
            # which materialises the whole score matrix: 2.7x slower for 512 queries over 6,000 keys).
            qs = q[span.query_start : span.query_start + span.query_len].transpose(0, 1)[None]
            ks = kv_quant.gather(k_cache, span.context_slots, qs.dtype).transpose(0, 1)[None]  # [1, KVH, C, hd]
            vs = kv_quant.gather(v_cache, span.context_slots, qs.dtype).transpose(0, 1)[None]
            os_ = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True)
            out[span.query_start : span.query_start + span.query_len] = os_[0].transpose(0, 1)
        out = out.reshape(num_tokens, self.q_size)
        y = self.o_proj(out, batch.decode_like_rows)
        if batch.lora is not None:
            batch.lora.add(self.ops, self.layer, "o", out, y)
        return y


# Rows of a long prompt chunk that go through the MLP together (see MLP.forward).
MLP_ROWS_PER_PASS = 128


class PassBuffers:
    """One model's MLP activations for up to MLP_ROWS_PER_PASS rows, [rows, 2 x intermediate] and [rows,
    intermediate] float32, which every layer's MLP writes in turn: a prefill step's biggest buffers, kept
    at one address. Allocated anew each pass they landed wherever glibc's heap had room, and each new
    place was faulted in afresh until the next trim (Qwen2.5-0.5B's 512-token steps: +27-50 MiB resident
    for a live peak of ~16)."""

    def __init__(self, intermediate: int):
        self.intermediate = intermediate
        self._gate_up = self._act = None

    def take(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of the first `len(x)` rows of each, for float32 rows `x` on the CPU (else, or past
        MLP_ROWS_PER_PASS rows, (None, None): the projections make their own)."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None, None
        if self._gate_up is None:  # at first use (models are built on the meta device), usable in and out
            with torch.inference_mode(False):  # of inference mode alike
                self._gate_up = torch.empty(MLP_ROWS_PER_PASS, 2 * self.intermediate, dtype=torch.float32)
                self._act = torch.empty(MLP_ROWS_PER_PASS, self.intermediate, dtype=torch.float32)
        if rows > self._gate_up.shape[0]:
            return None, None
        return self._gate_up[:rows], self._act[:rows]


class MLP(nn.Module):
    ops: TorchLayerOps = TORCH_OPS  # set per model at load (DecoderModel.layer_ops)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.pass_buffers = PassBuffers(cfg.intermediate_size)  # DecoderModel gives its layers one to share

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = x.shape[0]
        if (rows <= MLP_ROWS_PER_PASS or batch.lora is not None
                or not (self.gate_up_proj.rows_independent and self.down_proj.rows_independent)):
            return self._rows(x, batch.decode_like_rows, batch.lora)
        # A long prompt chunk in passes of rows: its [rows, 2 x intermediate] activations are the biggest
        # buffers of a step (30 MB at 512 rows on Qwen2.5-0.5B); on kernels whose rows are independent
        # every row's output keeps its bits.
        y = x.new_empty(rows, self.down_proj.out_features)
        for start in range(0, rows, MLP_ROWS_PER_PASS):
            end = min(start + MLP_ROWS_PER_PASS, rows)
            decode_like = min(max(batch.decode_like_rows - start, 0), end - start)
            self._rows(x[start:end], decode_like, None, into=y[start:end])
        return y

    def _rows(self, x: torch.Tensor, decode_like_rows: int, lora: LoRABatch | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of up to MLP_ROWS_PER_PASS rows (more under an adapter), its output written into `into`
        when given (and returned)."""
        gate_up_buffer, act_buffer = self.pass_buffers.take(x)
        gate_up = self.gate_up_proj(x, decode_like_rows, out=gate_up_buffer)
        if lora is not None:
            lora.add(self.ops, self.layer, "gate_up", x, gate_up)
        if gate_up.dtype != torch.float32:
            act_buffer = None
        act = (self.ops.gelu_tanh_mul(gate_up, act_buffer) if self.gelu
               else self.ops.silu_mul(gate_up, act_buffer))
        del gate_up
        y = self.down_proj(act, decode_like_rows, out=into)
        if lora is not None:
            lora.add(self.ops, self.layer, "down", act, y)
        if into is None or y is into:
            return y
        return into.copy_(y)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. With `sandwich_norms` each branch's
    output is normed again before the add (Gemma's post_attention / post_feedforward norms)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the MLP's input norm
        self.mlp = MLP(cfg, layer)
        sandwich = cfg.sandwich_norms
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None

    def forward(self, x, batch, rope, decode, k_cache, v_cache):
        """`x`, the step's residual stream (the model's own tensor), is added to in place and returned, as
        decoder_loop.c does: two [rows, hidden] buffers a layer fewer for a prefill step's heap."""
        h = self.self_attn(self.input_layernorm(x), batch, rope, decode, k_cache, v_cache)
        x.add_(h if self.attn_output_norm is None else self.attn_output_norm(h))
        h = self.mlp(self.post_attention_layernorm(x), batch)
        return x.add_(h if self.mlp_output_norm is None else self.mlp_output_norm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # No random init: its weights come from the file, and on the meta device (loader.py builds the
        # model there) the init runs torch's reference ops, which import torch._dynamo and sympy (75 MB).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        shared = PassBuffers(cfg.intermediate_size)
        for layer in self.layers:
            layer.mlp.pass_buffers = shared
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        keys = dict.fromkeys(cfg.layer_rope(i) for i in range(cfg.num_layers))
        self.ropes = nn.ModuleList(RotaryEmbedding(cfg.dim_per_head, *key) for key in keys)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.logits_proj: nn.Module | None = None  # a quantized LM head (model/quant/head.py), when chosen
        self.decode_attention = TorchDecodeAttention()  # or the paged C kernel, chosen at load
        self.kv_cache_dtype: torch.dtype | None = None  # None: the activations' dtype; set at load
        self.layer_ops = TORCH_OPS  # or the C ones (model/layer_ops.py), chosen at load
        self.decoder_loop = None  # all layers in one C call when every row takes the C kernels (set at load)
        layout = KVLayout.of(cfg)
        self.kv_group_windows = layout.group_windows
        self.layer_kv_groups = [layout.place(i)[0] for i in range(cfg.num_layers)]

    @property
    def rope(self) -> RotaryEmbedding:
        """The RoPE of the full-attention layers (the only one a Llama has)."""
        return next(r for r in self.ropes if r.key == (self.config.rope_theta, self.config.rope_scaling))

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self._layer_ops

    @layer_ops.setter
    def layer_ops(self, ops: TorchLayerOps) -> None:
        self._layer_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops
        self._drop_stale_decoder_loop()

    @property
    def decode_attention(self):
        return self._decode_attention_impl

    @decode_attention.setter
    def decode_attention(self, attention) -> None:
        self._decode_attention_impl = attention
        self._drop_stale_decoder_loop()

    def _drop_stale_decoder_loop(self) -> None:
        """The fused loop runs the ops and attention it was built from: when either is replaced it goes,
        here, once, instead of a check on every step."""
        loop = self.__dict__.get("decoder_loop")
        if loop is not None and (loop.ops is not self.layer_ops or loop.attention is not self.decode_attention):
            self.decoder_loop = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:  # in the weights' dtype, as Gemma's embedding does
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def _decode_attention(self, batch: ForwardBatch, window: int | None) -> tuple:
        """(attention, prepared) for one KV group's layers, prepared once a step."""
        attend = self.decode_attention
        return attend, attend.prepare(batch.decode_block_tables, batch.decode_context_lens, batch.block_size, window)

    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden states of all tokens, float32 logits at `batch.logits_indices`)."""
        x = self.embed(input_ids)
        ropes = {r.key: r(batch.positions, x.dtype) for r in self.ropes}
        views = [batch.for_group(g) for g in range(len(self.kv_group_windows))]
        decode = [self._decode_attention(view, window) if batch.num_decodes else None
                  for view, window in zip(views, self.kv_group_windows, strict=True)]
        if self.decoder_loop is not None and self.decoder_loop.applies(self, x, batch):
            x = self.decoder_loop(x, batch, ropes[self.rope.key], decode[0][1], kv_caches)
        else:
            for layer, group, (k_cache, v_cache) in zip(self.layers, self.layer_kv_groups, kv_caches, strict=True):
                x = layer(x, views[group], ropes[layer.self_attn.rope_key], decode[group], k_cache, v_cache)
        x = self.norm(x)
        return x, self.compute_logits(x[batch.logits_indices])

    @property
    def head_scans_argmax(self) -> bool:
        """Does the LM head find a float32 row's argmax without its logits (RescoredHead.scans)?"""
        return bool(getattr(self.logits_proj, "scans", False))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of `compute_logits(hidden)`, without the whole logits where the head can."""
        if self.head_scans_argmax:
            return self.logits_proj.argmax(hidden)
        return vocab_select.argmax(self.compute_logits(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
