"""The forward plan: how a model's forward runs, decided before the model is built (`plan_forward`) and
kept in one immutable record (`model.plan`), with the reason for each path not taken. Every entry point
(serve, generate, the offline `LLM`, the benchmarks) logs the same one line from it.

A choice is made by strategies, asked in order of preference: each answers `can_implement(needs, cpu) ->
(ok, reason)` for the model's shapes and dtypes (`ForwardNeeds`) on this CPU (`kernels.CPU`: its flags,
and the C libraries that build and pass their checks), and the first that can builds the implementation
the loader hands the model (`build`); the ones before it leave their reasons in the plan and its line.
The plan decides the weight format and the projections' kernel library (and which projections' shapes
the kernels do not take), the KV cache dtype, the layer ops, the attention kernel, the LM head's format
and the decoder loop. The loader applies it and `resolve_plan` adds what only the file can say (the
block formats the weights came from); an implementation the plan chose that then cannot be built is an
error, never a quiet fallback."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..config import KV_CACHE_DTYPES, EngineConfig
from . import decoder_loop, layer_ops, paged_attention
from .config import SLIDING, ModelConfig
from .kernels import CPU
from .kv_layout import KVLayout
from .quant import gemm, head, probe

# The exact path (float32 "none": token-exact against transformers) runs torch's ops alone: why the C
# strategies refuse it.
EXACT_PATH = "the exact path (--quantization none)"
_DTYPES = {name: getattr(torch, name) for name in KV_CACHE_DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}") from None


def kv_cache_dtype_for(quantization: str, dtype: str, asked: str = "auto") -> str:
    """The KV cache's dtype: `asked`, or for "auto" float16 on a quantized path (half the bytes a decode
    step reads; the C attention widens it exactly), else the residual stream's."""
    if asked != "auto":
        return asked
    return "float16" if quantization != "none" else dtype


@dataclass(frozen=True)
class ForwardNeeds:
    """What a model asks of the forward's implementations: the question each strategy answers."""

    dtype: torch.dtype  # the residual stream's (and the queries')
    kv_dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    exact: str | None = None  # why only torch's ops may run (the exact path), or None
    quantization: str = "none"  # the weights' format
    # The layers' shapes, for the choices that depend on more than attention's (the LM head, the loop).
    config: ModelConfig | None = field(default=None, compare=False)
    # The choices made before this one, by kind ("layer_ops", "attention", "projections"): the decoder
    # loop runs over them.
    before: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, exact: str | None = None,
           quantization: str = "none"):
        return cls(dtype, kv_dtype, config.dim_per_head, config.num_heads, config.num_kv_heads, exact,
                   quantization, config)


def projections_on_torch(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(projection, why) for each projection whose shape the C kernels do not take: it gets torch's op."""
    return tuple((name, why) for name, shape in config.projection_shapes.items() if (why := gemm.why_not(*shape)))


@dataclass(frozen=True)
class Choice:
    """One decision: what runs (`name`, built as `impl`), and why each strategy preferred to it does not."""

    name: str
    refused: tuple[tuple[str, str], ...] = ()  # (strategy, why not), in the order they were asked
    impl: object = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.name} ({self.refusals()})" if self.refused else self.name

    def refusals(self) -> str:
        """"not a, b: why; not c: why" (strategies refused for one reason share it)."""
        parts: list[list] = []
        for strategy, reason in self.refused:
            if parts and parts[-1][1] == reason:
                parts[-1][0].append(strategy)
            else:
                parts.append([[strategy], reason])
        return "; ".join("not " + ", ".join(names) + f": {why}" for names, why in parts)


def first_that_runs(strategies, needs: ForwardNeeds, cpu: CPU) -> Choice:
    """The first of `strategies` that can implement `needs` on `cpu`, built, with the others' reasons."""
    refused = []
    for strategy in strategies:
        ok, reason = strategy.can_implement(needs, cpu)
        if ok:
            return Choice(strategy.name, tuple(refused), strategy.build(needs, cpu))
        refused.append((strategy.name, reason))
    raise ValueError(f"no implementation runs here: {refused}")  # the last strategies (torch's) always can


@dataclass(frozen=True)
class ForwardPlan:
    architecture: str
    quantization: str  # the weights' format: "none" | "int4" | "int8"
    residual: str  # dtype of the residual stream
    kv_cache: str
    attention: Choice  # decode rows and prompt tokens through the paged cache
    layer_ops: Choice  # RMSNorm, RoPE, KV write, gated activation
    projections: Choice = Choice("dense")  # the quantized projections' kernels (impl: a QuantGemm, None: torch's)
    on_torch: tuple[tuple[str, str], ...] = ()  # (projection, why): shapes the planned kernels do not take
    lm_head: Choice = Choice(head.DENSE)  # the head's format (quant/head.py)
    decoder_loop: Choice = Choice(decoder_loop.OFF)  # impl: builds the loop over the loaded model
    attention_note: str = ""  # how sliding-window layers read the cache
    # Described as the model is loaded (`resolve_plan`):
    weights: str = ""  # the projections' format and kernel
    weight_sources: str = ""  # which of the file's block formats they came from
    head_rows: str = ""  # the head as loaded: its rescored rows and where they are read from, or tied
    long_prompts: str = ""  # what prefill chunks of SHORT_CHUNK rows or more go through

    def line(self) -> str:
        return (f"forward plan: {self.architecture}; weights {self.weights} (from {self.weight_sources}); "
                f"{self.residual} residual; {self.kv_cache} KV cache; attention {self.attention}{self.attention_note}; "
                f"layer ops {self.layer_ops}; LM head {self.lm_head}{self.head_rows}; long prompts {self.long_prompts}; "
                f"decoder loop {self.decoder_loop}")


def plan_forward(engine_config: EngineConfig, model_config: ModelConfig, cpu: CPU | None = None) -> ForwardPlan:
    """Decide how `model_config`'s forward runs under `engine_config` (its quantization, dtype and KV cache
    dtype) on `cpu` (this machine by default), before the model is built: the weight format (what runs
    here: `probe.choose`) and the projections' kernels, the KV cache dtype, the layer ops, the attention
    kernel, the LM head and the decoder loop, each the first of its strategies that can implement the
    model's needs, with the reasons of the ones before it."""
    cpu = cpu or CPU.here()
    asked = engine_config.quantization
    method, dtype = ("none", engine_config.dtype) if asked in (None, "none") else probe.choose(asked, engine_config.dtype)
    kv = kv_cache_dtype_for(method, dtype, engine_config.kv_cache_dtype)
    needs = ForwardNeeds.of(model_config, torch_dtype(dtype), torch_dtype(kv), EXACT_PATH if method == "none" else None,
                            method)
    before = {"attention": first_that_runs(paged_attention.STRATEGIES, needs, cpu),
              "layer_ops": first_that_runs(layer_ops.STRATEGIES, needs, cpu),
              "projections": first_that_runs(probe.STRATEGIES, needs, cpu) if method != "none" else Choice("dense")}
    after = dataclasses.replace(needs, before=before)
    return ForwardPlan(
        architecture=model_config.architecture, quantization=method, residual=dtype, kv_cache=kv, **before,
        on_torch=projections_on_torch(model_config) if before["projections"].impl is not None else (),
        lm_head=first_that_runs(head.STRATEGIES, after, cpu),
        decoder_loop=first_that_runs(decoder_loop.STRATEGIES, after, cpu), attention_note=_sliding_note(model_config))


def _sliding_note(config: ModelConfig) -> str:
    """How the attention reads sliding-window layers' caches ("" for a model without them)."""
    if not (config.layer_types and SLIDING in config.layer_types):
        return ""
    layout = KVLayout.of(config)
    return (f" (sliding layers read their last {config.sliding_window} positions; {layout.num_groups} KV "
            f"groups of {layout.layers_per_page} layers, blocks behind a window released)")


def plan_line(model) -> str:
    """The one line of a loaded model's plan; "" for a model object without one."""
    plan = getattr(model, "plan", None)
    return plan.line() if plan is not None else ""


def _dtype(t: torch.dtype | None) -> str:
    return str(t).removeprefix("torch.")


def resolve_plan(model, source_types: Counter, planned: ForwardPlan | None = None, unplanned: str = "") -> ForwardPlan:
    """`planned` (`plan_forward`'s) with what was loaded described (`source_types`: the file's block
    format of every projection weight). A model built without a plan (None) gets one read off its
    modules, the decoder loop's absence explained by `unplanned`."""
    from .gguf_tensors import StoredRows
    from .quant.modules import Int4Linear, Int8Linear

    cfg = model.config
    kinds: Counter = Counter()
    long_kinds: set[str] = set()
    kernel_names: set[str] = set()
    for layer in model.layers:
        for proj in decoder_loop.projections(layer):
            if isinstance(proj, (Int4Linear, Int8Linear)):
                kind = f"int{proj.bits}" if isinstance(proj, Int4Linear) else "int8 grouped" if proj.grouped else "int8"
                kinds[kind] += 1
                long_kinds.add("dense bf16 (oneDNN-packed)" if proj.dense is not None else kind)
                kernel_names.add(proj.kernel.name if proj.kernel is not None else "torch")
            else:
                kinds[_dtype(proj.weight.dtype)] += 1
                long_kinds.add(_dtype(proj.weight.dtype))
    if planned is None:
        loop = Choice(decoder_loop.LOOP) if model.decoder_loop is not None else Choice(
            decoder_loop.OFF, ((decoder_loop.LOOP, unplanned),))
        planned = ForwardPlan(
            architecture=cfg.architecture, quantization=getattr(model, "quantization", "none"),
            residual=_dtype(model.embed_tokens.weight.dtype), kv_cache=_dtype(model.kv_cache_dtype),
            attention=Choice(model.decode_attention.name), layer_ops=Choice(model.layer_ops.name),
            lm_head=Choice(head.format_of(model.logits_proj)), decoder_loop=loop, attention_note=_sliding_note(cfg))
    weights = ", ".join(f"{kind} x{n}" if len(kinds) > 1 else kind for kind, n in kinds.most_common())
    said = [planned.projections.refusals()] if planned.projections.refused else []
    said += [f"torch for {name}: {why}" for name, why in planned.on_torch]
    if kernel_names:
        weights += f" ({'; '.join([', '.join(sorted(kernel_names)) + ' kernels', *said])})"
    scan = model.logits_proj
    if isinstance(scan, head.RescoredHead):
        rows = f" from the file's {scan.weight.qtype} rows" if isinstance(scan.weight, StoredRows) else ""
        head_rows = f", top {scan.top} in float32{rows}"
    elif scan is None:
        head_rows = " (tied to the embedding)" if model.lm_head is None else f" ({_dtype(model.lm_head.weight.dtype)})"
    else:
        head_rows = ""
    sources = ", ".join(f"{n} {kind}" for kind, n in source_types.most_common()) or "random weights"
    return dataclasses.replace(planned, weights=weights, weight_sources=sources, head_rows=head_rows,
                               long_prompts=" / ".join(sorted(long_kinds)))
