"""Every decoder layer of a step in one C call (csrc/decoder_loop.c), for the steps where each row takes
the C kernels anyway: int4, int5 or int8 projections (with or without biases), C layer ops, the paged C
attention, rows that are single queries (decode tokens, short prompt chunks), a float32 residual
stream, and layers of the Llama / Qwen2 shape (pre-norm, SwiGLU, every layer attending to the whole
context) or Qwen3's (the same with QK-norm: each head of Q and K RMS-normed before RoPE, by the same
rms_norm kernel over rows of head_dim). The plan decides whether it runs (`STRATEGIES`, asked by
model/plan.py); the loader builds it over the loaded model, which must then be what the plan said (else
an error). Rows under LoRA adapters add their products through the same C kernel the Python layers
call (layer_ops.c's lora_add_bf16). The loop calls the kernels the Python layers would call, in their
order, on the same values, so a step's output is bit for bit the same (tests/test_decoder_loop.py);
what goes is the Python between ~400 kernel calls a step (about half a one-row step:
benchmarks/results/peers-*/). Any other step (long prefill chunks, the torch ops, a changed model) runs the layers in Python.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import kernels, kv_quant
from .config import SLIDING
from .layer_ops import LORA_MAX_RANK, CLayerOps
from .paged_attention import PagedDecodeAttention
from .quant import gemm
from .quant.modules import Int4Linear, Int8Linear

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Weight(ctypes.Structure):
    _fields_ = [("codes", _p), ("fifth", _p), ("scales", _p), ("offsets", _p), ("bias", _p), ("kind", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_attention_norm", _p), ("q_norm", _p), ("k_norm", _p),  # or NULL
                ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight), ("k_cache", _p),
                ("v_cache", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("int4_gemm", _p), ("int5_gemm", _p), ("int8_gemm", _p), ("int8g_gemm", _p), ("rms_norm", _p), ("rope", _p), ("write_kv", _p), ("write_kv_q8", _p), ("silu_mul", _p),
                ("attention", _p), ("lora_add", _p), ("num_layers", _i64), ("hidden", _i64), ("intermediate", _i64), ("heads", _i64),
                ("kv_heads", _i64), ("head_dim", _i64), ("cache_slots", _i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


class _LoRAWeight(ctypes.Structure):
    _fields_ = [("a", _p), ("b", _p), ("rank", _i64)]


class _LoRAStep(ctypes.Structure):
    _fields_ = [("slots", _p), ("layers", ctypes.POINTER(_LoRAWeight))]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the C loop's order


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _weight(linear: Int4Linear | Int8Linear) -> _Weight:
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    if isinstance(linear, Int8Linear):
        return _Weight(linear.codes.data_ptr(), None, linear.scales.data_ptr(), None, bias, 2 if linear.grouped else 1)
    fifth = linear.fifth.data_ptr() if linear.fifth is not None else None
    offsets = linear.offsets.data_ptr() if linear.offsets is not None else None  # None: symmetric codes
    return _Weight(linear.codes.data_ptr(), fifth, linear.scales.data_ptr(), offsets, bias, 3 if fifth else 0)


def _tensors(linear: Int4Linear | Int8Linear) -> list[torch.Tensor]:
    names = ("codes", "scales") + (("offsets", "fifth") if isinstance(linear, Int4Linear) else ())
    return [t for n in names if (t := getattr(linear, n)) is not None] + ([linear.bias] if linear.bias is not None else [])


class DecoderLoop:
    """Built at load for a model whose layers all run the C kernels (the plan's `CLoopStrategy`)."""

    def __init__(self, lib: ctypes.CDLL, model) -> None:
        if (reason := why_not_built(model)) is not None:
            raise ValueError(f"decoder loop: the model is not what the plan built it for: {reason}")
        self._run = lib.decoder_loop  # typed from csrc/kernels.h (kernels.load)
        cfg, layers = model.config, model.layers
        self.ops, self.attention = model.layer_ops, model.decode_attention  # what the loop was built from
        first = layers[0]
        # The loop reads these tensors through raw pointers: holding them keeps the memory alive even if
        # the model's modules were swapped later (the loop is built for the weights as loaded).
        self._weights = [t for layer in layers for t in (
            *norms(layer), *(t for proj in projections(layer) for t in _tensors(proj)))]
        self._head_dim = cfg.dim_per_head
        self._layers = (_Layer * len(layers))(*(
            _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   *(n.weight.data_ptr() if n is not None else None for n in qk_norms(layer)),
                   _weight(layer.self_attn.qkv_proj), _weight(layer.self_attn.o_proj),
                   _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj))
            for layer in layers))
        self._lora_weights: dict[tuple, tuple | None] = {}  # per set of adapters: its stacks for the loop
        # One model description per cache dtype the kernels take (the cache comes with each step): an
        # int8 cache's KV write takes its heads' shape (model/kv_quant.py).
        self._models = {}
        writes = {**{dtype: (write, None) for dtype, write in self.ops._write.items()},
                  torch.int8: (None, self.ops._write_q8)}
        for dtype, (write, write_q8) in writes.items():
            attend = self.attention.kernel_for(cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head, dtype)
            if attend is not None:
                kernel = first.self_attn.qkv_proj.kernel
                self._models[dtype] = _Model(
                    _address(kernel._int4), _address(kernel._int5), _address(kernel._int8), _address(kernel._int8g), _address(self.ops._rms_norm),
                    _address(self.ops._rope), write and _address(write), write_q8 and _address(write_q8),
                    _address(self.ops._silu_mul), _address(attend),
                    _address(self.ops._lora_add), len(layers), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.dim_per_head, 0, first.input_layernorm.eps, first.self_attn.scale)

    def applies(self, model, x: torch.Tensor, batch) -> bool:
        """The per-step shape test: every row a single query (and any adapters' stacks in bfloat16, as
        the C LoRA kernel takes them). Which kernels run was settled when the loop was built; a model
        whose ops or attention are replaced drops its loop then (DecoderModel.layer_ops)."""
        rows = x.shape[0]
        return (rows > 0 and not batch.prefills and batch.num_decodes == rows and batch.decode_like_rows >= rows
                and x.dtype == torch.float32
                and (batch.lora is None or self._lora_weights_for(batch.lora) is not None))

    def _lora_weights_for(self, lora) -> tuple | None:
        """(ctypes array of every layer's 4 projections' stacks, the tensors it points into) for the
        step's set of adapters, made once per set (the last 4 kept); None when the C kernel cannot take
        them (not bfloat16, or a rank above its bound)."""
        key = lora.adapters
        if key not in self._lora_weights:
            while len(self._lora_weights) >= 4:
                del self._lora_weights[next(iter(self._lora_weights))]
            entries, tensors = [], []
            for layer in range(len(self._layers)):
                for proj in _PROJECTIONS:
                    stacked = lora.stacks.get(key, layer, proj)
                    if stacked is None:
                        entries.append(_LoRAWeight(None, None, 0))
                        continue
                    a, b = stacked
                    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.shape[2] > LORA_MAX_RANK:
                        self._lora_weights[key] = None
                        return None
                    tensors += [a, b]  # held: the array points into them
                    entries.append(_LoRAWeight(a.data_ptr(), b.data_ptr(), a.shape[2]))
            self._lora_weights[key] = ((_LoRAWeight * len(entries))(*entries), tensors)
        return self._lora_weights[key]

    def __call__(self, x: torch.Tensor, batch, rope, prepared, kv_caches) -> torch.Tensor:
        """x [rows, hidden] (the embeddings) -> the residual stream after the last layer, in place."""
        tables, context_lens, block_size = prepared
        k0 = kv_caches[0][0]
        model = self._models.get(k0.dtype)
        if model is None or k0.shape[1:] != (model.kv_heads, kv_quant.row_elements(k0.dtype, model.head_dim)) or any(
                not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == k0.dtype
                     and k.shape == v.shape == k0.shape) for k, v in kv_caches):
            raise ValueError(f"decoder loop: no kernels for a {k0.dtype} KV cache of shape {tuple(k0.shape)}")
        model.cache_slots = k0.shape[0]
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        x = x.contiguous()
        cos, sin = (t.contiguous() for t in rope)
        slots, rows = batch.slot_mapping.contiguous(), x.shape[0]
        if slots.dtype != torch.int64 or slots.numel() != rows:
            raise ValueError("decoder loop: slot_mapping must be int64 with one slot per row")
        if tables.shape[0] != rows or any(t.dtype != torch.float32 or t.numel() != rows * self._head_dim
                                          for t in (cos, sin)):
            raise ValueError("decoder loop: block tables and RoPE tables must have one row per token")
        step = None
        if batch.lora is not None:
            weights, _ = self._lora_weights_for(batch.lora)
            slots_of = batch.lora.slots.contiguous()
            step = ctypes.byref(_LoRAStep(slots_of.data_ptr(), weights))
        status = self._run(ctypes.byref(model), self._layers, step, x.data_ptr(), rows, cos.data_ptr(),
                           sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                           context_lens.data_ptr(), block_size)
        if status == 1:
            raise IndexError(f"KV write: a slot outside the cache's {k0.shape[0]} rows")
        if status:
            raise MemoryError("decoder loop: out of memory for its scratch buffer or a kernel's, or a LoRA product failed")
        return x


def projections(layer) -> tuple:
    """A layer's four projections, in the C loop's order (`_PROJECTIONS`)."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def qk_norms(layer) -> tuple:
    """A layer's QK-norm modules (q_norm, k_norm), or (None, None) for a layer without them."""
    return layer.self_attn.q_norm, layer.self_attn.k_norm


def norms(layer) -> tuple:
    """The weights of every norm the loop applies in `layer`."""
    return (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *(n.weight for n in qk_norms(layer) if n is not None))


def why_not_layers(config) -> str | None:
    """Why layers of `config`'s shape are not the loop's (None: they are). QK-norm (Qwen3) is: the loop
    norms every head of Q and K as the Python layers do; Gemma 3's GeGLU, sandwich norms and sliding
    windows are not."""
    unfit = [what for what, there in (("GeGLU", config.hidden_act != "silu"),
                                      ("sandwich norms", config.sandwich_norms),
                                      ("sliding windows", SLIDING in (config.layer_types or ()))) if there]
    if unfit:
        return (f"{config.architecture} layers ({', '.join(unfit)}) are not the shape it was written and "
                "checked for")
    return None


def why_not_built(model) -> str | None:
    """Why the loop cannot run `model` as built (None: it can)."""
    if (reason := why_not_layers(model.config)) is not None:
        return reason
    if not isinstance(model.layer_ops, CLayerOps):
        return "the layer ops are torch's"
    if not isinstance(model.decode_attention, PagedDecodeAttention):
        return "attention is torch's"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"the residual stream is {model.embed_tokens.weight.dtype}, the loop's is float32"
    kernel = None
    for layer in model.layers:
        for proj in projections(layer):
            if not isinstance(proj, (Int4Linear, Int8Linear)) or proj.kernel is None:
                return "a projection is not an int4 or int8 weight on the C kernels"
            if proj.kernel is not (kernel or proj.kernel):
                return "projections use different C kernel libraries"
            kernel = proj.kernel
        if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms(layer)):
            return "a norm weight is not contiguous float32"
        q_norm, k_norm = qk_norms(layer)
        if (q_norm is None) != (k_norm is None) or (q_norm is not None and not all(
                n.weight.shape == (model.config.dim_per_head,) for n in (q_norm, k_norm))):
            return "a layer's QK-norm is not a q_norm and a k_norm of head_dim each"
        # The loop applies every norm with one eps (its _Model's).
        eps = {n.eps for n in (layer.input_layernorm, layer.post_attention_layernorm, q_norm, k_norm)
               if n is not None}
        if eps != {model.layers[0].input_layernorm.eps}:
            return "the norms' eps differ"
    return None


LOOP, OFF = "c", "off"


class CLoopStrategy:
    """The loop, over the plan's earlier choices (`needs.before`): C layer ops, the paged C attention and
    every projection on the C kernels, a float32 residual stream, layers of a shape it was written for
    (Llama, Qwen2, Qwen3), and its library built and checked."""

    name = LOOP

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        before, config = needs.before, needs.config
        if needs.exact:
            return False, needs.exact
        if (reason := why_not_layers(config)) is not None:
            return False, reason
        if before["layer_ops"].name != CLayerOps.name:
            return False, "the layer ops are torch's"
        if not isinstance(before["attention"].impl, PagedDecodeAttention):
            return False, "attention is torch's"
        if needs.dtype != torch.float32:
            return False, f"a {str(needs.dtype).removeprefix('torch.')} residual stream (the loop's is float32)"
        if before["projections"].impl is None:
            return False, "the projections run torch's ops"
        for name, shape in config.projection_shapes.items():
            if (why := gemm.why_not(*shape)) is not None:
                return False, f"{name} runs torch's op ({why})"
        if kernels.load(SPEC) is None:
            return False, "its C library did not build or check"
        return True, None

    def build(self, needs, cpu: kernels.CPU):
        return functools.partial(DecoderLoop, kernels.load(SPEC))  # called with the loaded model


class OffStrategy:
    """Every step's layers in Python."""

    name = OFF

    def can_implement(self, needs, cpu: kernels.CPU) -> tuple[bool, str | None]:
        return True, None

    def build(self, needs, cpu: kernels.CPU) -> None:
        return None


STRATEGIES = (CLoopStrategy(), OffStrategy())  # in order of preference


# csrc/checks/decoder_loop.c: three layers (one with QK-norm) over stand-in kernels against the same
# arithmetic done directly.
SPEC = kernels.KernelSpec("decoder_loop", frozenset(), (), check="decoder_loop")
