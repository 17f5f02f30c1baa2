"""The forward plan: every choice about how a model's forward runs, made once at load and kept in one
immutable record (`model.plan`), with the reason for each path not taken. Every entry point (serve,
generate, the offline `LLM`, the benchmarks) logs the same one line from it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .config import SLIDING
from .kv_layout import KVLayout


@dataclass(frozen=True)
class ForwardPlan:
    architecture: str
    weights: str  # the projections' format and kernel
    weight_sources: str  # which of the file's block formats they came from
    residual: str  # dtype of the residual stream
    kv_cache: str
    attention: str  # decode rows and prompt tokens through the paged cache
    layer_ops: str  # RMSNorm, RoPE, KV write, gated activation
    lm_head: str
    long_prompts: str  # what prefill chunks of SHORT_CHUNK rows or more go through
    decoder_loop: str  # "on" or "off: why"

    def line(self) -> str:
        return (f"forward plan: {self.architecture}; weights {self.weights} (from {self.weight_sources}); "
                f"{self.residual} residual; {self.kv_cache} KV cache; attention {self.attention}; "
                f"layer ops {self.layer_ops}; LM head {self.lm_head}; long prompts {self.long_prompts}; "
                f"decoder loop {self.decoder_loop}")


def plan_line(model) -> str:
    """The one line of a loaded model's plan; "" for a model object without one."""
    plan = getattr(model, "plan", None)
    return plan.line() if plan is not None else ""


def _dtype(t: torch.dtype | None) -> str:
    return str(t).removeprefix("torch.")


def resolve_plan(model, source_types: Counter, loop_reason: str | None) -> ForwardPlan:
    """Describe the model as loaded (`source_types`: the file's block format of every projection weight)."""
    from .gguf_tensors import StoredRows
    from .quant.head import RescoredHead
    from .quant.modules import Int4Linear, Int8Linear

    cfg = model.config
    kinds: Counter = Counter()
    long_kinds: set[str] = set()
    kernel_names: set[str] = set()
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if isinstance(proj, (Int4Linear, Int8Linear)):
                kind = f"int{proj.bits}" if isinstance(proj, Int4Linear) else "int8 grouped" if proj.grouped else "int8"
                kinds[kind] += 1
                long_kinds.add("dense bf16 (oneDNN-packed)" if proj.dense is not None else kind)
            else:
                kinds[_dtype(proj.weight.dtype)] += 1
                long_kinds.add(_dtype(proj.weight.dtype))
            if getattr(proj, "kernel", None) is not None:
                kernel_names.add(proj.kernel.name)
            elif isinstance(proj, (Int4Linear, Int8Linear)):
                kernel_names.add("torch")
    weights = ", ".join(f"{kind} x{n}" if len(kinds) > 1 else kind for kind, n in kinds.most_common())
    if kernel_names:
        weights += f" ({', '.join(sorted(kernel_names))} kernels)"
    long_prompts = " / ".join(sorted(long_kinds))
    head = model.logits_proj
    if isinstance(head, RescoredHead):
        lm_head = f"{head.format}, top {head.top} rescored in float32"
        if isinstance(head.weight, StoredRows):
            lm_head += f" from the file's {head.weight.qtype} rows"
    elif head is not None:
        lm_head = "int8"
    else:
        lm_head = "tied to the embedding" if model.lm_head is None else _dtype(model.lm_head.weight.dtype)
    attention = model.decode_attention.name
    if cfg.layer_types and SLIDING in cfg.layer_types:
        layout = KVLayout.of(cfg)
        attention += (f" (sliding layers read their last {cfg.sliding_window} positions; {layout.num_groups} KV "
                      f"groups of {layout.layers_per_page} layers, blocks behind a window released)")
    sources = ", ".join(f"{n} {kind}" for kind, n in source_types.most_common()) or "random weights"
    return ForwardPlan(
        architecture=cfg.architecture, weights=weights, weight_sources=sources,
        residual=_dtype(model.embed_tokens.weight.dtype), kv_cache=_dtype(model.kv_cache_dtype),
        attention=attention, layer_ops=model.layer_ops.name, lm_head=lm_head, long_prompts=long_prompts,
        decoder_loop="on" if model.decoder_loop is not None else f"off: {loop_reason}")
