"""Every decoder layer of a step in one C call (csrc/decoder_loop.c), for the steps where each row takes
the C kernels anyway: int4, int5 or int8 projections (with or without biases), C layer ops, the paged C
attention, rows that are single queries (decode tokens, short prompt chunks), a float32 residual
stream, and layers of the Llama / Qwen2 shape (pre-norm, SwiGLU, every layer attending to the whole
context). Rows under LoRA adapters add their products through the same C kernel the Python layers
call (layer_ops.c's lora_add_bf16). The loop calls the kernels the Python layers would call, in their
order, on the same values, so a step's output is bit for bit the same (tests/test_decoder_loop.py);
what goes is the Python between ~400 kernel calls a step (3.2 of 6.9 ms at one row, 5.4 of 25.7 ms at
32). Any other step (long prefill chunks, the torch ops, a changed model) runs the layers in Python.
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels
from .config import SLIDING
from .layer_ops import LORA_MAX_RANK, CLayerOps
from .linear import Int4Linear, Int8Linear
from .paged_attention import PagedDecodeAttention

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Weight(ctypes.Structure):
    _fields_ = [("codes", _p), ("fifth", _p), ("scales", _p), ("offsets", _p), ("bias", _p), ("kind", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_attention_norm", _p), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("k_cache", _p), ("v_cache", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("int4_gemm", _p), ("int5_gemm", _p), ("int8_gemm", _p), ("int8g_gemm", _p), ("rms_norm", _p), ("rope", _p), ("write_kv", _p), ("silu_mul", _p),
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
    """Built at load for a model whose layers all run the C kernels (`decoder_loop_for`)."""

    def __init__(self, lib: ctypes.CDLL, model) -> None:
        self._run = lib.decoder_loop
        self._run.argtypes = [_p, _p, _p, _p, _i64, _p, _p, _p, _p, _i64, _p, _i64]
        self._run.restype = ctypes.c_int
        cfg, layers = model.config, model.layers
        self.ops, self.attention = model.layer_ops, model.decode_attention  # what the loop was built from
        first = layers[0]
        # The loop reads these tensors through raw pointers: holding them keeps the memory alive even if
        # the model's modules were swapped later (the loop is built for the weights as loaded).
        self._weights = [t for layer in layers for t in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *(t for proj in _projections(layer) for t in _tensors(proj)))]
        self._cache_shape = (cfg.num_kv_heads, cfg.dim_per_head)
        self._head_dim = cfg.dim_per_head
        self._layers = (_Layer * len(layers))(*(
            _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                   _weight(layer.self_attn.qkv_proj), _weight(layer.self_attn.o_proj),
                   _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj))
            for layer in layers))
        self._lora_weights: dict[tuple, tuple | None] = {}  # per set of adapters: its stacks for the loop
        # One model description per cache dtype the kernels take (the cache comes with each step).
        self._models = {}
        for dtype, write in self.ops._write.items():
            attend = self.attention.kernel_for(cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head, dtype)
            if attend is not None:
                kernel = first.self_attn.qkv_proj.kernel
                self._models[dtype] = _Model(
                    _address(kernel._int4), _address(kernel._int5), _address(kernel._int8), _address(kernel._int8g), _address(self.ops._rms_norm),
                    _address(self.ops._rope), _address(write), _address(self.ops._silu_mul), _address(attend),
                    _address(self.ops._lora_add), len(layers), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.dim_per_head, 0, first.input_layernorm.eps, first.self_attn.scale)

    def applies(self, model, x: torch.Tensor, batch) -> bool:
        """Every row a single query through the int4 kernels, on the kernels the loop was built from (and
        any adapters' stacks in bfloat16, as the C LoRA kernel takes them)."""
        rows = x.shape[0]
        return (rows > 0 and not batch.prefills and batch.num_decodes == rows and batch.decode_like_rows >= rows
                and x.dtype == torch.float32 and model.layer_ops is self.ops
                and model.decode_attention is self.attention
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
        if model is None or k0.shape[1:] != self._cache_shape or any(
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


def _projections(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def why_no_decoder_loop(model) -> str | None:
    """Why the loop cannot run `model` (None: it can, if its library builds and checks)."""
    cfg = model.config
    if cfg.qk_norm or cfg.sandwich_norms or cfg.hidden_act != "silu" or SLIDING in (cfg.layer_types or ()):
        return (f"{cfg.architecture} layers (QK-norm, GeGLU, extra norms or sliding windows) are not the shape "
                "it was written and checked for")
    if not isinstance(model.layer_ops, CLayerOps):
        return "the layer ops are torch's (float32 activations and the C library are needed)"
    if not isinstance(model.decode_attention, PagedDecodeAttention):
        return "attention is torch's"
    if model.embed_tokens.weight.dtype != torch.float32:
        return f"the residual stream is {model.embed_tokens.weight.dtype}, the loop's is float32"
    kernel = None
    for layer in model.layers:
        for proj in _projections(layer):
            if not isinstance(proj, (Int4Linear, Int8Linear)) or proj.kernel is None:
                return "a projection is not an int4 or int8 weight on the C kernels"
            if proj.kernel is not (kernel or proj.kernel):
                return "projections use different C kernel libraries"
            kernel = proj.kernel
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms):
            return "a norm weight is not contiguous float32"
    return None


def decoder_loop_for(model) -> tuple[DecoderLoop | None, str | None]:
    """(the loop, None) when every layer of `model` runs the C kernels and the library builds and
    checks, else (None, why not)."""
    reason = why_no_decoder_loop(model)
    if reason is not None:
        return None, reason
    lib = kernels.load(SPEC)
    return (DecoderLoop(lib, model), None) if lib is not None else (None, "its C library did not build or check")


# Run in a child (model/kernels.py): two layers over stand-in kernels (Python callbacks: each norm
# scales by its weight, each int4 gemm sums its input row times a per-weight number, the int8 one
# (layer 1's down projection) twice that, the grouped int8 one (layer 0's down projection) three times,
# the int5 one (layer 1's gate/up) four times, a LoRA product adds a constant to its rows,
# the attention passes the queries through; layer 0's QKV has a bias), against the same arithmetic
# done directly.
_CHECK = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
p, i64, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
P = ctypes.POINTER
val = lambda ptr, i: ctypes.cast(ptr, P(ctypes.c_float))[i]
def store(ptr, i, v): ctypes.cast(ptr, P(ctypes.c_float))[i] = v
def gemm(x, rows, k, codes, scales, offsets, n, y):
    for r in range(rows):
        s = sum(val(x, r * k + i) for i in range(k))
        for j in range(n): store(y, r * n + j, s * val(codes, 0) + j)
    return 0
def norm(x, w, rows, dim, eps, out):
    for i in range(rows * dim): store(out, i, val(x, i) * val(w, i % dim))
def attention(q, kc, vc, tables, max_blocks, lens, rows, heads, kv_heads, head_dim, block_size, scale, out):
    for i in range(rows * heads * head_dim): store(out, i, val(q, i) * scale)
    return 0
written = []
def write_kv(k, ks, v, vs, rows, width, slots, num_slots, kc, vc):
    written.append((rows, width, num_slots)); return 0
def silu_mul(gu, rows, inter, out):
    for r in range(rows):
        for i in range(inter): store(out, r * inter + i, val(gu, r * 2 * inter + i) - val(gu, r * 2 * inter + inter + i))
def gemm8(x, rows, k, codes, scales, n, y):
    for r in range(rows):
        s = sum(val(x, r * k + i) for i in range(k))
        for j in range(n): store(y, r * n + j, 2 * s * val(codes, 0) + j)
    return 0
def gemm8g(x, rows, k, codes, scales, n, y):
    for r in range(rows):
        s = sum(val(x, r * k + i) for i in range(k))
        for j in range(n): store(y, r * n + j, 3 * s * val(codes, 0) + j)
    return 0
lora_calls = []
def lora_add(x, rows, k, slots, a, b, rank, n, y):  # adds a's first value to every output of a row under an adapter
    lora_calls.append((k, rank, n))
    for r in range(rows):
        if ctypes.cast(slots, P(i64))[r] >= 0:
            for j in range(n): store(y, r * n + j, val(y, r * n + j) + val(a, 0))
    return 0
def gemm5(x, rows, k, codes, fifth, scales, offsets, n, y):  # int5: four times the int4 stand-in
    for r in range(rows):
        s = sum(val(x, r * k + i) for i in range(k))
        for j in range(n): store(y, r * n + j, 4 * s * val(codes, 0) + j)
    return 0
callbacks = [ctypes.CFUNCTYPE(ctypes.c_int, p, i64, i64, p, p, p, i64, p)(gemm),
             ctypes.CFUNCTYPE(ctypes.c_int, p, i64, i64, p, p, p, p, i64, p)(gemm5),
             ctypes.CFUNCTYPE(ctypes.c_int, p, i64, i64, p, p, i64, p)(gemm8),
             ctypes.CFUNCTYPE(ctypes.c_int, p, i64, i64, p, p, i64, p)(gemm8g),
             ctypes.CFUNCTYPE(None, p, p, i64, i64, f, p)(norm),
             ctypes.CFUNCTYPE(None, p, i64, i64, i64, i64, p, p)(lambda *a: None),
             ctypes.CFUNCTYPE(ctypes.c_int, p, i64, p, i64, i64, i64, p, i64, p, p)(write_kv),
             ctypes.CFUNCTYPE(None, p, i64, i64, p)(silu_mul),
             ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, p, i64, p, i64, i64, i64, i64, i64, f, p)(attention),
             ctypes.CFUNCTYPE(ctypes.c_int, p, i64, i64, p, p, p, i64, i64, p)(lora_add)]
class Model(ctypes.Structure):
    _fields_ = [(n, p) for n in "gemm gemm5 gemm8 gemm8g norm rope write silu attn lora".split()] + [(n, i64) for n in "L H I heads kvh hd slots".split()] + [("eps", f), ("scale", f)]
ROWS, H, I, HEADS, KVH, HD, LAYERS = 2, 4, 3, 2, 1, 2, 2
m = Model(*[ctypes.cast(c, p) for c in callbacks], LAYERS, H, I, HEADS, KVH, HD, 7, 1e-5, 0.5)
F = lambda *v: (ctypes.c_float * len(v))(*v)
weights = [F(1.0, 2.0, 0.5, 1.0), F(0.5, 0.5, 1.0, 2.0)] + [F(c) for c in (0.25, 0.5, 1.0, -0.125, 0.75, 0.5, 0.25, 1.0)]
QKV, Q = (HEADS + 2 * KVH) * HD, HEADS * HD
bias = F(*[0.125 * j - 0.5 for j in range(QKV)])
# (layer, projection) through the int8 gemm (x2), the grouped one (x3) or int5 (x4); the rest int4 (x1)
int8 = {(1, 3): 2, (0, 3): 3, (1, 2): 4}
has_bias = {(0, 0)}
weight = lambda l, j: [ctypes.addressof(weights[2 + 4 * l + j]), 0, 0, 0, ctypes.addressof(bias) if (l, j) in has_bias else 0, {2: 1, 3: 2, 4: 3}.get(int8.get((l, j)), 0)]
layer = lambda l: [ctypes.addressof(weights[l])] * 2 + sum((weight(l, j) for j in range(4)), []) + [0, 0]
layers = (p * (28 * LAYERS))(*(layer(0) + layer(1)))
x0 = [0.5, -1.0, 2.0, 0.25, 1.5, 0.0, -0.5, 1.0]
zeros = (i64 * 8)()
# The LoRA step: row 1 under an adapter whose only projection is layer 1's o (its A's first value 0.75).
lora_a, row_slots = F(0.75), (i64 * ROWS)(-1, 0)
lora_weights = (i64 * (3 * 4 * LAYERS))()  # (a, b, rank) per layer and projection; b is never read here
lora_weights[3 * 5:3 * 6] = [ctypes.addressof(lora_a), ctypes.addressof(lora_a), 4]  # layer 1, projection 1 (o)
lora_step = (p * 2)(ctypes.addressof(row_slots), ctypes.addressof(lora_weights))
for step in (None, lora_step):
    x = list(x0)
    buf = F(*x)
    assert lib.decoder_loop(ctypes.byref(m), layers, step, buf, ROWS, F(*[1.0] * 4), F(*[0.0] * 4), zeros, zeros, 1, zeros, 16) == 0
    for l in range(LAYERS):
        c = [weights[2 + 4 * l + j][0] * int8.get((l, j), 1) for j in range(4)]
        for r in range(ROWS):
            row = x[r * H:(r + 1) * H]
            qkv = [sum(v * weights[l][i] for i, v in enumerate(row)) * c[0] + j + (bias[j] if l == 0 else 0) for j in range(QKV)]
            attended = [v * 0.5 for v in qkv[:Q]]
            adapted = 0.75 if step is not None and l == 1 and r == 1 else 0
            row = [v + sum(attended) * c[1] + j + adapted for j, v in enumerate(row)]
            gu = [sum(v * weights[l][i] for i, v in enumerate(row)) * c[2] + j for j in range(2 * I)]
            act = [gu[i] - gu[I + i] for i in range(I)]
            x[r * H:(r + 1) * H] = [v + sum(act) * c[3] + j for j, v in enumerate(row)]
    for i, v in enumerate(x):
        assert abs(buf[i] - v) < 1e-4 * (1 + abs(v)), (step is not None, i, buf[i], v)
assert lora_calls == [(Q, 4, H)], lora_calls  # once, for layer 1's o projection: k = q_size, n = hidden
assert written == [(ROWS, KVH * HD, 7)] * 2 * LAYERS, written
"""

SPEC = kernels.KernelSpec("decoder_loop", frozenset(), (), _CHECK)
