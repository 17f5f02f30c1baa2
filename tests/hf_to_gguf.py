"""A Hugging Face directory (as transformers saves it) written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes these families: Llama's Q/K rows permuted for its interleaved RoPE,
Gemma's norms stored as the multiplier, Llama 3's RoPE scaling as a `rope_freqs` table of factors.
Projections (and the embedding and head) in float32 or, with `qtype`, in one of the block formats gguf's
own quantizer writes (Q4_0, Q4_1, Q5_0, Q8_0): what the fast paths' kernels then read as stored."""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's, kept fused
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_params(hf: dict) -> dict:
    p = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 10000.0))
    return p.get("full_attention", p)


def llama3_factors(head_dim: int, p: dict) -> np.ndarray:
    """llama.cpp's converter's table for rope_type llama3 (its loop, in float64 over float32 frequencies)."""
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                              p["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert(hf_dir: str, path: str, qtype: str | None = None) -> None:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    arch = GGUF_ARCH[hf["architectures"][0]]
    sd = {k.removeprefix("model."): v.astype(np.float32) for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    gemma = arch == "gemma3"
    w = gguf.GGUFWriter(path, arch)
    add_tensor = w.add_tensor

    def add_matrix(name: str, t: np.ndarray) -> None:
        if qtype is None:
            return add_tensor(name, t)
        kind = gguf.GGMLQuantizationType[qtype]
        data = gguf.quants.quantize(t, kind)
        add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    p = rope_params(hf)
    w.add_rope_freq_base(p["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    sliding = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if sliding or "rope_local_base_freq" in hf:
        w.add_rope_freq_base_swa(sliding["rope_theta"] if sliding else hf["rope_local_base_freq"])
    if p.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(head_dim, p))
    elif p.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(p["rope_type"]))
        w.add_rope_scaling_factor(p["factor"])
        if "original_max_position_embeddings" in p:
            w.add_rope_scaling_orig_ctx_len(p["original_max_position_embeddings"])
    norm = (lambda t: t + 1) if gemma else (lambda t: t)
    add_matrix("token_embd.weight", sd["embed_tokens.weight"])
    w.add_tensor("output_norm.weight", norm(sd["norm.weight"]))
    if "lm_head.weight" in sd and not hf.get("tie_word_embeddings"):
        add_matrix("output.weight", sd["lm_head.weight"])
    rope_permuted = arch == "llama"
    for i in range(hf["num_hidden_layers"]):
        hp, b = f"layers.{i}.", f"blk.{i}."
        for part, n in (("q", heads), ("k", kv_heads), ("v", None)):
            for kind in ("weight", "bias"):
                t = sd.get(f"{hp}self_attn.{part}_proj.{kind}")
                if t is not None:
                    add = add_matrix if kind == "weight" else w.add_tensor
                    add(f"{b}attn_{part}.{kind}", permute(t, n) if rope_permuted and n else t)
        for theirs, ours in FUSED.items():
            if f"{hp}{theirs}.weight" in sd:
                add_matrix(f"{b}{ours}.weight", sd[f"{hp}{theirs}.weight"])
        add_matrix(b + "attn_output.weight", sd[hp + "self_attn.o_proj.weight"])
        for theirs, ours in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            if f"{hp}mlp.{theirs}.weight" in sd:
                add_matrix(f"{b}{ours}.weight", sd[f"{hp}mlp.{theirs}.weight"])
        for theirs, ours in (GEMMA_NORMS if gemma else NORMS).items():
            if f"{hp}{theirs}.weight" in sd:
                w.add_tensor(f"{b}{ours}.weight", norm(sd[f"{hp}{theirs}.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
